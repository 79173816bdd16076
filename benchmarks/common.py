"""Shared pieces of the benchmark scripts: real-text prompts, the HF peer, machine facts.

Prompts are real English text from Python's ``pydoc_data.topics`` cut to exact token counts with
the model's tokenizer. The Hugging Face peer loads the same bundled GGUF weights with
``gguf_file=`` at the same dtype and thread count.
"""

from __future__ import annotations

import os
import platform
import statistics
import time
from datetime import date

import torch

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def real_text_ids(tokenizer, n_tokens: int, offset: int = 0) -> list[int]:
    """``n_tokens`` token ids of pydoc topics text, starting ``offset`` topics in."""
    from pydoc_data import topics

    texts = list(topics.topics.values())
    text = "\n\n".join(texts[offset:] + texts[:offset])
    ids = tokenizer.encode(text)
    assert len(ids) >= n_tokens, "pydoc topics are shorter than the requested prompt"
    return ids[:n_tokens]


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
