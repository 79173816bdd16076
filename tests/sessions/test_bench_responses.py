"""``kvledger bench --api responses`` against a served fake engine."""

from __future__ import annotations

import json
import subprocess
import sys

from fake_engine import TEXT


def _bench(url, out, *args):
    return subprocess.run([sys.executable, "-m", "kvledger.cli", "bench", "--url", url,
                           "--workload", "chat-growth", "--api", "responses", "--turns", "4",
                           "--turn-tokens", "20", "--output-len", "30", "--out", str(out),
                           *args], capture_output=True, text=True, timeout=300, check=False)


def test_growth_rows_and_plot(served, tmp_path):
    url, _ = served
    done = _bench(url, tmp_path, "--memory", "full,window")
    assert done.returncode == 0, done.stderr
    lines = (tmp_path / "responses_growth.csv").read_text().splitlines()
    assert lines[0].startswith("policy,turn,prompt_tokens,cached_tokens")
    rows = [line.split(",") for line in lines[1:]]
    assert [(r[0], r[1]) for r in rows] == [(p, str(t)) for p in ("full", "window")
                                             for t in range(1, 5)]
    prompts = [int(r[2]) for r in rows[:4]]
    assert prompts == sorted(prompts) and prompts[0] < prompts[-1]
    assert all(int(r[4]) == len(TEXT) for r in rows)
    assert (tmp_path / "responses_growth.png").stat().st_size > 1000


def test_recall_counts_numbers_in_replies(served, tmp_path):
    url, _ = served
    done = _bench(url, tmp_path, "--memory", "summary", "--recall")
    assert done.returncode == 0, done.stderr
    (result,) = json.loads((tmp_path / "responses_recall.json").read_text())
    assert result["asked"] == 10 and result["recalled"] == 0  # the fake always says TEXT
    assert "summary: recalled 0/10" in done.stdout


def test_bad_policy_and_workload(tmp_path):
    done = _bench("http://127.0.0.1:9", tmp_path, "--memory", "forever")
    assert done.returncode == 2 and "--memory takes a comma list" in done.stderr
