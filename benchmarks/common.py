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


def median_time(fn, repeat: int) -> float:
    """Median wall time of ``fn()`` in seconds over ``repeat`` runs (after one warm-up)."""
    fn()
    times = []
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def machine_line(threads: int) -> str:
    """One line naming the machine, threads, torch version and date."""
    cpu = platform.processor() or platform.machine()
    return (f"{date.today()} · {os.cpu_count()} CPUs ({cpu}) · {threads} torch threads · "
            f"torch {torch.__version__}")
