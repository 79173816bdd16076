"""Models at a real config's shapes with kvledger's dummy weights, for the benchmarks that run
llama.cpp on the same file (``bench_families.py``, ``bench_moe.py``, ``bench_mla.py``).

A model is a Hugging Face folder (the config, kvledger's dummy weights in bf16 as
``--load-format dummy`` makes them, and the bundled model's tokenizer with its vocabulary padded
by unused entries to the model's size, so that llama.cpp's converter keeps the real embedding
and LM head), turned into GGUF by ``peer_llamacpp.convert_hf_to_gguf``. Each benchmark has two
subcommands: ``prepare`` (not timed: the folders and files) and ``time``.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def padded_tokenizer(folder: Path, vocab_size: int) -> None:
    """The bundled tokenizer saved in ``folder``, its BPE vocabulary padded to ``vocab_size``
    entries that no merge produces (the encoding is unchanged)."""
    from kvledger.model.weights.loader import load_tokenizer

    load_tokenizer("default").save_pretrained(folder)
    path = folder / "tokenizer.json"
    doc = json.loads(path.read_text())
    vocab = doc["model"]["vocab"]
    for i in range(len(vocab), vocab_size):
        vocab[f"<unused_{i}>"] = i
    path.write_text(json.dumps(doc))


def dummy_folder(folder: Path, config: dict) -> Path:
    """``folder`` holding ``config`` (a ``config.json``), its dummy weights in bf16
    (``model.safetensors``) and the :func:`padded_tokenizer`."""
    import torch
    from safetensors.torch import save_file

    from kvledger.model.weights.loader import load_weights

    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config, indent=1))
    spec, weights = load_weights(folder, torch.bfloat16, "dummy")
    save_file({k: v.contiguous() for k, v in weights.items()}, folder / "model.safetensors")
    del weights
    padded_tokenizer(folder, spec.vocab_size)
    return folder


def command_line(models, new: int) -> tuple[argparse.ArgumentParser, argparse.ArgumentParser,
                                             argparse.ArgumentParser]:
    """(the parser, its ``prepare`` and its ``time`` subparser), for a script to add its own
    options: ``prepare --work DIR --llama-src SRC [--sentencepiece DIR]`` and ``time --work
    DIR [--threads 2] [--new new] [--models ...]`` (``models``: the choices)."""
    ap = argparse.ArgumentParser()
    sub = ap.add_subparsers(dest="cmd", required=True)
    prepare = sub.add_parser("prepare")
    prepare.add_argument("--work", required=True)
    prepare.add_argument("--llama-src", required=True)
    prepare.add_argument("--sentencepiece", default="")
    time = sub.add_parser("time")
    time.add_argument("--work", required=True)
    time.add_argument("--threads", type=int, default=2)
    time.add_argument("--new", type=int, default=new)
    time.add_argument("--models", nargs="*", choices=models)
    return ap, prepare, time
