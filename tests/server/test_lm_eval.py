"""lm-eval (EleutherAI's harness, an independent client) scores our multiple-choice task through
``kvledger serve`` as its in-process ``hf`` backend scores it on the same GGUF in fp32
(benchmarks/lm_eval/compare_backends.py: equal accuracy, equal log-likelihoods to 1e-4).

Skipped when lm-eval is not installed (``pip install kvledger[lm-eval]``).
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

TASK_DIR = Path(__file__).resolve().parents[2] / "benchmarks" / "lm_eval"


def test_the_task_has_50_or_more_well_formed_questions():
    items = [json.loads(line) for line in (TASK_DIR / "kvledger_mc.jsonl").read_text()
             .splitlines()]
    assert len(items) >= 50
    assert len({item["question"] for item in items}) == len(items)
    for item in items:
        assert len(item["choices"]) == 4 and len(set(item["choices"])) == 4
        assert item["answer"] in range(4)


@pytest.mark.slow
def test_lm_eval_through_the_server_equals_hf_in_fp32(tmp_path):
    pytest.importorskip("lm_eval", reason="lm-eval is not installed: pip install "
                                          "kvledger[lm-eval]")
    pytest.importorskip("tenacity", reason="lm-eval's API models need lm-eval[api]")
    spec = importlib.util.spec_from_file_location("compare_backends",
                                                  TASK_DIR / "compare_backends.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    # the first 24 questions keep it within the suite's time limit on 2 busy cores (the
    # whole task: benchmarks/lm_eval/compare_backends.py, figures in docs/vllm-compat.md)
    figures = module.compare("fp32", limit=24, log=tmp_path / "serve.log")
    assert figures["items"] == 24 and figures["choices"] == 4 * 24
    assert figures["acc_served"] == figures["acc_hf"]
    assert figures["items_scored_differently"] == []
    assert figures["max_abs_delta"] < 1e-4
