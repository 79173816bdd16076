"""``kvledger plan --kv-policy``: the bounded per-request KV and the concurrency it buys, in
the same paged blocks the scheduler admits by (hand-computed figures)."""

from __future__ import annotations

import json

from typer.testing import CliRunner

from kvledger.cli import app

ARGS = ["plan", "default", "--device", "custom", "--memory-gib", "8", "--bandwidth-gbs", "50",
        "--tflops", "1", "--context", "2k,8k", "--json"]


def test_sinks_plan_bounds_kv_and_buys_concurrency():
    result = CliRunner().invoke(app, [*ARGS, "--kv-policy", "sinks", "--kv-window", "1024"])
    assert result.exit_code == 0, result.output
    plan = json.loads(result.output)
    pool = plan["pool_blocks"]
    rows = {r["context"]: r for r in plan["retention"]}
    # 4 sinks + 1024 recent: 1027 held between steps + one 64-token chunk = 1091 tokens,
    # ceil(1091 / 16) = 69 blocks + the sinks block + the window's first block = 71
    for n in (2048, 8192):
        assert rows[n]["kv_tokens"] == 1091 and rows[n]["kv_blocks"] == 71
        assert rows[n]["kv_bytes"] == 71 * plan["block_bytes"]
        assert rows[n]["max_concurrency"] == pool // 71
    assert rows[8192]["full_kv_blocks"] == 512 and rows[8192]["full_max_concurrency"] == pool // 512
    assert rows[8192]["max_concurrency"] > 7 * rows[8192]["full_max_concurrency"]


def test_full_plan_has_no_retention_rows_and_bad_policies_exit_2():
    result = CliRunner().invoke(app, ARGS)
    assert result.exit_code == 0 and json.loads(result.output)["retention"] == []
    bad = CliRunner().invoke(app, [*ARGS, "--kv-policy", "sinks", "--kv-window", "0"])
    assert bad.exit_code == 2 and "--kv-window must be an integer in [1, 2^31)" in bad.output
    bad = CliRunner().invoke(app, [*ARGS, "--kv-window", "64"])
    assert bad.exit_code == 2 and "needs kv_policy" in bad.output
