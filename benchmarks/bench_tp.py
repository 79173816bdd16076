"""Tensor-parallel step time (issue 16): TP 1 vs 2 vs 3 on one machine, and the share of each
step spent in the collectives (the all-reduces after attention and the MLP, the logits gather).

The bundled SmolLM2-135M has 9 query heads, which 2 does not divide; so the default model is
a random-weight Llama of the same shape (hidden 576, 30 layers, MLP 1536, vocab 49,152, head
dim 48) with 12 query / 6 KV heads, which 1, 2, 3 and 6 divide (``--model`` takes any other;
the bundled one runs TP 1 and 3). Weights are random: only time is measured.

Per TP size: one engine, each rank on ``cores // tp`` torch threads (at least 1); a prefill of
one ``--prompt``-token request; then ``--batch`` requests decoding together, the median step
time over ``--steps`` decode steps after a warm-up, and rank 0's time inside collectives
(``RankGroup.comm_s``: transfer plus waiting for the slowest rank) as a share of it.

Usage: python benchmarks/bench_tp.py [--tp 1,2,3] [--dtype fp32|bf16] [--batch 8]
       [--prompt 256] [--steps 32] [--model PATH] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time

import torch
from common import DTYPES, machine_line

from kvledger.engine.config import EngineConfig
from kvledger.engine.engine import LLMEngine
from kvledger.engine.sample.sampling_params import SamplingParams


def random_model(folder: str) -> str:
    """Save the SmolLM2-shaped 12/6-head random Llama to ``folder``; return it."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536,
                      num_hidden_layers=30, num_attention_heads=12, num_key_value_heads=6,
                      head_dim=48, max_position_embeddings=2048, tie_word_embeddings=True,
                      rms_norm_eps=1e-5, bos_token_id=1, eos_token_id=2)
    LlamaForCausalLM(cfg).save_pretrained(folder, safe_serialization=True)
    return folder


def measure(model: str, tp: int, dtype: str, batch: int, prompt: int, steps: int) -> dict:
    from kvledger.model.weights.loader import load_weights

    spec, weights = load_weights(model, DTYPES[dtype])
    engine = LLMEngine(EngineConfig(model=model, dtype=dtype, tensor_parallel_size=tp,
                                    attention="paged-native", num_blocks=batch * 40),
                       spec=spec, weights=weights)
    group = engine.parallel.group if engine.parallel is not None else None
    params = SamplingParams(max_tokens=steps + 3, temperature=0.0, ignore_eos=True)
    ids = [[(7 * i + 13 * j) % 40000 + 10 for j in range(prompt)] for i in range(batch + 1)]
    engine.add_request("prefill", ids[-1], SamplingParams(max_tokens=1))
    t = time.perf_counter()
    engine.step()
    prefill_s = time.perf_counter() - t
    for i in range(batch):
        engine.add_request(f"d{i}", ids[i], params)
    while any(r.num_computed_tokens < r.num_prompt_tokens
              for r in engine.scheduler.requests.values()):
        engine.step()  # the batch's prefills
    engine.step()  # warm-up decode
    times, comm = [], []
    for _ in range(steps):
        before = group.comm_s if group else 0.0
        t = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - t)
        comm.append((group.comm_s if group else 0.0) - before)
    engine.close()
    step = statistics.median(times)
    return {"tp": tp, "prefill_ms": round(prefill_s * 1e3, 1),
            "decode_step_ms": round(step * 1e3, 2),
            "comm_share": round(statistics.median(c / s for c, s in zip(comm, times)), 3)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tp", default="1,2,3")
    ap.add_argument("--dtype", default="fp32", choices=("fp32", "bf16"))
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--prompt", type=int, default=256)
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--model", default=None)
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        model = a.model or random_model(tmp)
        rows = [measure(model, int(tp), a.dtype, a.batch, a.prompt, a.steps)
                for tp in a.tp.split(",")]
    print(machine_line(0).replace("0 torch threads", "cores // tp torch threads per rank"))
    print(f"model {a.model or 'random 12q/6kv SmolLM2-shaped'}, {a.dtype}, prefill "
          f"{a.prompt} tokens, decode batch {a.batch}, median of {a.steps} steps")
    print("| TP | prefill (ms) | decode step (ms) | collective share of a decode step |")
    print("| --- | --- | --- | --- |")
    for r in rows:
        print(f"| {r['tp']} | {r['prefill_ms']} | {r['decode_step_ms']} | "
              f"{r['comm_share']:.0%} |")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
