"""Helpers of the tensor-parallel tests: an engine on a folder's weights, greedy runs that keep
every step's logits, and the worker processes this test process started."""

from __future__ import annotations

import os

import torch

from kvledger.engine.config import EngineConfig

GREEDY = {"max_tokens": 16, "temperature": 0.0, "ignore_eos": True}


def tp_engine(folder, tp: int, **options):
    """An fp32 engine on ``folder``'s weights (loaded here) with ``tp`` ranks."""
    from kvledger.engine.engine import LLMEngine
    from kvledger.model.weights.loader import load_weights

    spec, weights = load_weights(folder, torch.float32)
    return LLMEngine(EngineConfig(model=str(folder), dtype="fp32", attention="paged-native",
                                  tensor_parallel_size=tp, **options), spec=spec, weights=weights)


def greedy(engine, prompts: list[list[int]], **params
           ) -> tuple[list[list[int]], list[torch.Tensor]]:
    """Tokens of each prompt (GREEDY, ``params`` on top), and the logits of every step
    (prefill, then each decode)."""
    from kvledger.engine.sample.sampling_params import SamplingParams

    seen, execute = [], engine.runner.execute
    engine.runner.execute = lambda chunks, *rest: seen.append(execute(chunks, *rest)) or seen[-1]
    for i, ids in enumerate(prompts):
        engine.add_request(f"r{i}", ids, SamplingParams(**{**GREEDY, **params}))
    done = {}
    while engine.has_unfinished_requests():
        done.update({o.request_id: o.token_ids for o in engine.step() if o.finished})
    engine.runner.execute = execute
    return [done[f"r{i}"] for i in range(len(prompts))], seen


def workers_of_this_process() -> list[int]:
    """Pids of live tensor-parallel workers whose parent is this process."""
    pids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                cmd = f.read()
        except OSError:
            continue
        if ppid == os.getpid() and b"kvledger.engine.parallel.worker" in cmd:
            pids.append(int(entry))
    return pids
