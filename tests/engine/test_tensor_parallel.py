"""Tensor parallelism (issue 16): the split of the weights, per-rank KV bytes against the
ledger, logits and tokens of TP = 2 / 3 / 4 against TP = 1, and a killed worker.

The oracle of the multi-process tests is the TP = 1 engine on the same weights (itself checked
against transformers in tests/model/test_llama.py): a rank that held the wrong heads, a missing
or doubled all-reduce, or a wrong vocabulary slice moves the logits far past 1e-4.
"""

from __future__ import annotations

import os
import signal

import pytest
import torch
from tp_harness import greedy, tp_engine, workers_of_this_process
from typer.testing import CliRunner

from kvledger.engine.config import EngineConfig
from kvledger.engine.kv.layout import resolve_layout
from kvledger.engine.parallel.shard import kv_head_range, shard_spec, shard_weights
from kvledger.errors import InvalidParameterError
from kvledger.ledger.kv import kv_bytes_per_block
from kvledger.ledger.kv_format import KVFormatSpec
from kvledger.model.families import load_spec

FP32 = KVFormatSpec("fp32")


def test_split_follows_the_gqa_rule_and_recomposes_the_mlp(tiny_llama_folder):
    from kvledger.model.weights.loader import load_weights

    bundled = load_spec("default")
    with pytest.raises(InvalidParameterError, match=r"size 2 does not divide the model's heads "
                                                    r"\(9 query, 3 KV heads\)"):
        shard_spec(bundled, 2)
    spec, weights = load_weights(tiny_llama_folder(heads=4, kv_heads=1), torch.float32)
    # query head j reads KV head j // group: with one KV head every rank holds head 0
    assert [list(kv_head_range(spec, 4, r)) for r in range(4)] == [[0]] * 4
    two = load_spec(tiny_llama_folder())  # 4 query heads over 2 KV heads
    assert [list(kv_head_range(two, 4, r)) for r in range(4)] == [[0], [0], [1], [1]]
    assert [list(kv_head_range(two, 2, r)) for r in range(2)] == [[0], [1]]
    x = torch.randn(5, spec.hidden_size)
    p = "model.layers.1.mlp."

    def mlp(w):
        gate, up = x @ w[p + "gate_proj.weight"].T, x @ w[p + "up_proj.weight"].T
        return (torch.nn.functional.silu(gate) * up) @ w[p + "down_proj.weight"].T

    parts = [mlp(shard_weights(weights, spec, 4, r)) for r in range(4)]
    torch.testing.assert_close(sum(parts), mlp(weights), atol=1e-5, rtol=1e-5)
    heads = [shard_weights(weights, spec, 4, r)["lm_head.weight"] for r in range(4)]
    torch.testing.assert_close(torch.cat(heads)[: spec.vocab_size], weights["lm_head.weight"])


@pytest.mark.parametrize("tp,heads,kv_heads", [(3, None, None), (2, 4, 2), (4, 4, 1)])
def test_rank_pool_holds_the_ledger_per_rank_bytes(tp, heads, kv_heads, tiny_llama_folder):
    """Each rank's store == blocks x the ledger's per-rank block bytes == ``kvledger plan
    --tp``'s block bytes (bundled: 16 x 30 layers x 2 x 1 KV head x 64 x 4 B = 245,760)."""
    spec = load_spec("default" if heads is None else tiny_llama_folder(heads=heads,
                                                                       kv_heads=kv_heads))
    config = EngineConfig(dtype="fp32", tensor_parallel_size=tp)
    store = resolve_layout(config, spec, torch.float32).build_store(7)
    assert store.nbytes == 7 * kv_bytes_per_block(spec, FP32, tp, 16)
    assert store.nbytes == 7 * 2 * spec.num_layers * 16 * max(spec.num_kv_heads // tp, 1) \
        * spec.head_dim * 4
    if heads is None:
        assert store.nbytes == 7 * 245_760


def test_bad_sizes_are_one_line_errors():
    from kvledger.cli import app

    result = CliRunner().invoke(app, ["generate", "hi", "-tp", "2"])
    assert result.exit_code == 2
    assert "does not divide the model's heads (9 query, 3 KV heads)" in result.output
    with pytest.raises(InvalidParameterError, match=r"tensor_parallel_size must be an integer in \[1, 1024\], got 0"):
        EngineConfig(tensor_parallel_size=0)


@pytest.mark.slow
def test_bundled_tp3_logits_and_tokens_equal_tp1():
    """9 query / 3 KV heads over 3 ranks: prefill + 16 decode steps within 1e-4 (fp32)."""
    from kvledger.engine.engine import LLMEngine

    prompt = [[1, 504, 3458, 282, 4649, 314, 216, 30, 51, 2533, 1345, 28, 27, 2124]]
    results = {}
    for tp in (1, 3):
        engine = LLMEngine(EngineConfig(dtype="fp32", attention="paged-native", num_blocks=32,
                                        tensor_parallel_size=tp))
        results[tp] = greedy(engine, prompt)
        if tp == 3:
            per_block = kv_bytes_per_block(engine.spec, FP32, 3, 16)
            assert engine.stats()["kv_pool_bytes_per_rank"] == [32 * per_block] * 3
        engine.close()
    (tokens1, logits1), (tokens3, logits3) = results[1], results[3]
    assert tokens3 == tokens1 and len(logits3) == len(logits1) == 16
    for a, b in zip(logits1, logits3):
        torch.testing.assert_close(b, a, atol=1e-4, rtol=0)


@pytest.mark.slow
@pytest.mark.parametrize("tp,kv_heads", [(2, 2), (4, 1)])
def test_tiny_tp_equals_tp1_alone_and_batched_with_preemption(tp, kv_heads, tiny_llama_folder):
    """One prompt: logits of every step within 1e-4; then a batch under a pool small enough to
    preempt (chunked prefill, prefix hits): the same tokens as TP = 1."""
    folder = tiny_llama_folder(heads=4, kv_heads=kv_heads, vocab=322)  # 322: a ragged split
    alone = [list(range(3, 40))]
    batch = [list(range(3 + i, 50 + 7 * i)) for i in range(5)] + [list(range(3, 40))]
    options = {"num_blocks": 14, "max_num_batched_tokens": 32}
    runs = {}
    for size in (1, tp):
        engine = tp_engine(folder, size, **options)
        runs[size] = (greedy(engine, alone), greedy(engine, batch),
                      engine.stats())
        if size > 1:
            workers = engine.parallel.workers
            engine.close()
            assert [w.returncode for w in workers] == [0] * (tp - 1)
    (one, batch1, stats1), (many, batch_tp, stats_tp) = runs[1], runs[tp]
    assert many[0] == one[0]
    for a, b in zip(one[1], many[1]):
        torch.testing.assert_close(b, a, atol=1e-4, rtol=0)
    assert batch_tp[0] == batch1[0]
    assert stats_tp["num_preemptions"] == stats1["num_preemptions"] > 0
    assert stats_tp["prefix_cache_hit_tokens"] == stats1["prefix_cache_hit_tokens"] > 0
    spec = load_spec(folder)
    per_block = kv_bytes_per_block(spec, FP32, tp, 16)
    assert stats_tp["kv_pool_bytes_per_rank"] == [14 * per_block] * tp


@pytest.mark.slow
def test_killed_worker_gives_503_health_says_why_and_nothing_is_left(tiny_llama_folder,
                                                                     app_client):
    engine = tp_engine(tiny_llama_folder(), 2, num_blocks=32, tp_timeout_s=30)
    client = app_client(engine)
    body = {"model": engine.model_name, "prompt": [5, 6, 7, 8], "max_tokens": 4}
    assert client.post("/v1/completions", json=body).status_code == 200
    assert client.get("/health").status_code == 200
    evicting = {**body, "prompt": list(range(3, 60)), "max_tokens": 6,
                "kv_policy": {"policy": "h2o", "budget": 20, "window": 6, "sinks": 2}}
    reply = client.post("/v1/completions", json=evicting)  # a per-request retention policy
    assert reply.status_code == 200, reply.text
    assert reply.json()["usage"]["completion_tokens"] == 6
    per_rank = engine.stats()["kv_pool_bytes_per_rank"]
    assert per_rank == [32 * kv_bytes_per_block(engine.spec, FP32, 2, 16)] * 2
    assert f'rank="1"}} {float(per_rank[1])}' in client.get("/metrics").text
    (worker,) = engine.parallel.workers
    os.kill(worker.pid, signal.SIGKILL)
    failed = client.post("/v1/completions", json=body)  # within tp_timeout_s at the latest
    assert failed.status_code == 503, failed.text
    health = client.get("/health")
    assert health.status_code == 503
    assert "worker rank 1" in health.json()["error"]["message"]
    assert "exited (signal 9)" in health.json()["error"]["message"]
    assert client.post("/v1/completions", json=body).status_code == 503
    engine.close()
    assert workers_of_this_process() == []
