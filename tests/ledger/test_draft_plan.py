"""``kvledger plan --draft-model``: the draft's weights and KV in the pool and the verify
step's price per k, checked by hand on Qwen3-0.6B drafting for Qwen3-8B on an H100."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from kvledger.cli import app
from kvledger.errors import InvalidParameterError
from kvledger.ledger.draft_plan import draft_plan
from kvledger.ledger.hardware import get_device
from kvledger.ledger.planner import PlanOptions, plan
from kvledger.ledger.speculation import expected_tokens
from kvledger.model.catalogue import load_model_spec

TARGET = load_model_spec("Qwen/Qwen3-8B")
DRAFT = load_model_spec("Qwen/Qwen3-0.6B")
H100 = get_device("H100-SXM")
OPTIONS = PlanOptions(contexts=(4096, 32768))
GiB = 2**30


def _plan(draft=DRAFT, options=OPTIONS, k=5):
    return draft_plan(TARGET, draft, H100, options, plan(TARGET, H100, options), k)


def test_memory_by_hand():
    """Weights: 8B 8,190,735,360 params x 2 = 16,381,470,720 bytes, the draft 596,049,920 x 2
    = 1,192,099,840 (its config's counts: tied embeddings). Pool: 0.9 x 80 GiB - both - 2 GiB
    = 57,588,357,120. KV per token: target 36 layers x 2 x 8 heads x 128 x 2 bytes = 147,456,
    draft 28 x 2 x 8 x 128 x 2 = 114,688; a block of 16 tokens of both 4 MiB. A 4,096-token
    request: 256 blocks = 1 GiB, 53 of them (53.6); 32,768: 8 GiB, 6 (6.7). Without the draft
    the plan's own 97 and 12."""
    d = _plan()
    assert d.weights_bytes == 1_192_099_840 and d.kv_bytes_per_token == 114_688
    assert d.pool_bytes == 57_588_357_120 and d.block_bytes == 4 * 2**20
    assert d.pool_blocks == 57_588_357_120 // (4 * 2**20)
    rows = [(r.context, r.draft_kv_bytes_per_sequence, r.max_concurrency,
             r.max_concurrency_without_draft) for r in d.contexts]
    assert rows == [(4096, 256 * 16 * 114_688, 53, 97), (32768, 2048 * 16 * 114_688, 6, 12)]


def test_verify_rows_break_even_where_expected_tokens_meet_the_price():
    """Each row's break-even acceptance a solves E(a, k) = the step's price ratio (k = 1:
    1 + a = ratio); the ratio grows with k (every k a draft forward and a token more)."""
    d = _plan()
    assert [v.k for v in d.verify] == [1, 2, 3, 4, 5]
    assert d.verify[0].break_even_acceptance == pytest.approx(d.verify[0].step_ratio - 1,
                                                              abs=1e-6)
    for v in d.verify:
        assert v.step_ratio == pytest.approx(v.step_s / v.plain_step_s)
        assert expected_tokens(v.break_even_acceptance, v.k) == pytest.approx(v.step_ratio,
                                                                             rel=1e-6)
    assert all(a.step_ratio < b.step_ratio for a, b in zip(d.verify, d.verify[1:]))


def test_refusals():
    with pytest.raises(InvalidParameterError, match="vocabulary of 49152 tokens.*151936"):
        _plan(load_model_spec("HuggingFaceTB/SmolLM2-135M"))
    with pytest.raises(InvalidParameterError, match="sliding-window or state layers"):
        _plan(load_model_spec("Qwen/Qwen3-Next-80B-A3B-Thinking"))
    with pytest.raises(InvalidParameterError, match="tensor parallelism"):
        _plan(options=PlanOptions(contexts=(4096,), tp=2))
    with pytest.raises(InvalidParameterError, match="num-speculative-tokens"):
        _plan(k=0)


def test_cli():
    r = CliRunner().invoke(app, ["plan", "Qwen/Qwen3-8B", "--draft-model", "Qwen/Qwen3-0.6B",
                                 "--context", "4k", "--json", "--num-speculative-tokens", "2"])
    assert r.exit_code == 0, r.output
    out = json.loads(r.stdout)
    assert out["draft"]["contexts"][0]["max_concurrency"] == 53
    assert [v["k"] for v in out["draft"]["verify"]] == [1, 2]
    r = CliRunner().invoke(app, ["plan", "Qwen/Qwen3-8B", "--draft-model",
                                 "HuggingFaceTB/SmolLM2-135M"])
    assert r.exit_code == 2 and "error:" in r.output and "Traceback" not in r.output
