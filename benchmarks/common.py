"""Shared pieces of the benchmark scripts: real-text prompts, the HF peer, machine facts.

Prompts are real English text from Python's ``pydoc_data.topics`` cut to exact token counts with
the model's tokenizer. The Hugging Face peer loads the same bundled GGUF weights with
``gguf_file=`` at the same dtype and thread count.
"""

from __future__ import annotations

import functools
import os
import platform
import statistics
import time
from datetime import date
from pathlib import Path

import torch

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def real_text_ids(tokenizer, n_tokens: int, offset: int = 0) -> list[int]:
    """``n_tokens`` token ids of pydoc topics text, starting ``offset`` tokens in.

    Different offsets give different prompts (no shared prefix unless the ranges overlap).
    """
    ids = _topic_ids(tokenizer)
    assert offset + n_tokens <= len(ids), "pydoc topics are shorter than the requested range"
    return ids[offset:offset + n_tokens]


@functools.cache
def _topic_ids(tokenizer) -> list[int]:
    from pydoc_data import topics

    return tokenizer.encode("\n\n".join(topics.topics.values()))


def load_hf_peer(dtype: str):
    """transformers' model and tokenizer for the bundled GGUF (the peer and oracle)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from kvledger.paths import bundled_model_path

    path = bundled_model_path()
    tok = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name,
                                                 dtype=DTYPES[dtype]).eval()
    return model, tok


def peak_rss_bytes(pid: int) -> int | None:
    """Peak resident set size of a live process, bytes (``VmHWM`` of ``/proc/PID/status``, the
    figure ``/usr/bin/time -v`` reports at exit); None when it cannot be read."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return None
    for line in status.splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    return None


def tpot_floor_ms(weight_bytes: int, kv_bytes: int) -> float | None:
    """The decode step's floor, ms: ``weight_bytes + kv_bytes`` read at the memory bandwidth
    ``kvledger probe`` measured (the ledger's :func:`kvledger.ledger.costs.tpot_floor_s`); None
    before a probe."""
    from kvledger.errors import KVLedgerError
    from kvledger.ledger.costs import tpot_floor_s
    from kvledger.ledger.hardware import get_device

    try:
        bandwidth = get_device("local").bandwidth_bytes_per_s
    except KVLedgerError:
        return None
    return tpot_floor_s(weight_bytes, kv_bytes, bandwidth) * 1e3


def decode_step_times(engine, prompts: list, params_list: list) -> list[float]:
    """Seconds of each engine step in which every request of ``prompts`` (each with its
    ``params_list`` entry) decodes one token: the steps after all have their first token."""
    for i, (prompt, params) in enumerate(zip(prompts, params_list)):
        engine.add_request(f"r{time.monotonic_ns()}-{i}", prompt, params)
    started, times = set(), []
    while engine.has_unfinished_requests():
        all_decoding = len(started) == len(prompts)
        t = time.perf_counter()
        outputs = engine.step()
        elapsed = time.perf_counter() - t
        if all_decoding and len(outputs) == len(prompts):
            times.append(elapsed)
        started.update(o.request_id for o in outputs if o.token_ids)
    return times


def median_time(fn, repeat: int) -> float:
    """Median wall time of ``fn()`` in seconds over ``repeat`` runs (after one warm-up)."""
    fn()
    times = []
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


SIMD_FLAGS = ("sse4_2", "avx", "avx2", "fma", "f16c", "avx512f", "avx512_bf16", "avx512_vnni",
              "amx_tile", "amx_bf16", "amx_int8")


def machine_line(threads: int) -> str:
    """One line naming the machine (CPU model and its SIMD flags), threads, torch, date."""
    from kvledger.device.cpu.native import cpu_identity

    model, _, flags = cpu_identity().partition(" | ")
    simd = [f for f in SIMD_FLAGS if f in flags.split()] or ["none listed"]
    return (f"{date.today()} · {os.cpu_count()} CPUs ({model or platform.machine()}; "
            f"{' '.join(simd)}) · {threads} torch threads · torch {torch.__version__}")
