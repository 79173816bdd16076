"""Replay fixtures: a live run of a tiny GGUF model recorded as a trace."""

from __future__ import annotations

import dataclasses
import random

import pytest

BLOCK = 4
LIVE_OPTIONS = {"num_blocks": 22, "block_size": BLOCK, "max_num_batched_tokens": 24,
                "max_num_seqs": 5}


def record_live(engine, path, private: bool = False, seed: int = 0) -> None:
    """Drive ``engine`` through a mixed workload, recording it: a shared prefix, prompts of
    5-40 tokens, new requests arriving between steps, EOS allowed (temperature 1, seeded)."""
    from kvledger.engine.sample.sampling_params import SamplingParams
    from kvledger.replay.recorder import TracingEngine
    from kvledger.replay.trace import TraceWriter

    writer = TraceWriter(path, "test", engine.model_name, private, BLOCK,
                         dataclasses.asdict(engine.config), engine.scheduler.kv.pool.num_blocks)
    traced = TracingEngine(engine, writer)
    rng = random.Random(seed)
    shared = [rng.randrange(2, 10) for _ in range(12)]
    sent, step = 0, 0
    while sent < 14 or traced.has_unfinished_requests():
        if sent < 14 and step % 2 == 0:
            head = shared if sent % 2 else []
            prompt = head + [rng.randrange(2, 10) for _ in range(rng.randrange(5, 28))]
            params = SamplingParams(max_tokens=rng.randrange(3, 24), seed=sent)
            traced.add_request(f"r{sent}", prompt, params)
            sent += 1
        if traced.has_unfinished_requests():
            traced.step()
        step += 1
    writer.close()


@pytest.fixture
def tiny_engine(tmp_path, gguf_kit):
    """A factory of LLMEngines over a one-layer random GGUF (vocab 10, 512-token context)."""
    import torch

    from kvledger.engine.config import EngineConfig
    from kvledger.engine.engine import LLMEngine
    from kvledger.model.weights.loader import load_weights

    tensors = gguf_kit.to_gguf(gguf_kit.hf_weights(tied=False))
    path = gguf_kit.write(tmp_path / "tiny.gguf", tensors, extra={"context_length": 512})
    spec, weights = load_weights(path, torch.float32)

    def build(**options):
        config = EngineConfig(model=str(path), **(LIVE_OPTIONS | options))
        return LLMEngine(config, spec=spec, weights=weights)

    build.path = path
    return build


@pytest.fixture
def live_trace(tiny_engine, tmp_path):
    """Record a live run (``record_live``) of a fresh tiny engine; returns (trace path, engine)."""

    def run(private: bool = False, seed: int = 0, **options):
        engine = tiny_engine(**options)
        path = tmp_path / f"live-{private}-{seed}.jsonl"
        record_live(engine, path, private, seed)
        return path, engine

    return run
