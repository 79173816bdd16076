"""The KV fingerprint: a digest of everything that changes the bytes of a stored KV block.

A block stored by one engine is loaded by another only when their fingerprints are equal. The
fingerprint covers the weights' content (:func:`weights_digest`), the compute dtype, the weight
format of each linear class in use (the kernel probe's choice), the device kind, the RoPE
settings (a ``nope`` model's absence of RoPE), the µP multipliers when the model has them
(they scale what reaches K and V: Granite), the full ``KVFormatSpec`` JSON with a digest of the calibrated outlier channels, the
block size, the tensor-parallel size, rank and layer groups, and the tier's file-format
version (``block_file.FORMAT_VERSION``).
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import torch

from kvledger.engine.kv.tiers.block_file import FORMAT_VERSION

_CHUNK = 1 << 22
_CACHE_NAME = "weights-digests.json"


def _file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def _cached_file_sha256(path: Path, cache: Path) -> str:
    """sha256 of a file, remembered in ``cache`` under (path, size, mtime)."""
    st = path.stat()
    tag = f"{path.resolve()}|{st.st_size}|{st.st_mtime_ns}"
    try:
        known = json.loads(cache.read_text())
        if not isinstance(known, dict):
            known = {}
    except (OSError, ValueError):
        known = {}
    if isinstance(known.get(tag), str):
        return known[tag]
    digest = known[tag] = _file_sha256(path)
    try:
        cache.parent.mkdir(parents=True, exist_ok=True)
        tmp = cache.with_name(f"{cache.name}.{os.getpid()}")
        tmp.write_text(json.dumps(known))
        tmp.replace(cache)
    except OSError:
        pass  # an unwritable cache only costs the hash next time
    return digest


def weights_digest(model_path: Path, cache: Path) -> str:
    """Content digest of a model's weights: a GGUF file's sha256, or the sha256 of a folder's
    safetensors and config files' digests (each cached by path, size and mtime in ``cache``)."""
    if model_path.is_file():
        return _cached_file_sha256(model_path, cache)
    names = sorted(p for p in model_path.iterdir()
                   if p.suffix == ".safetensors" or p.name == "config.json")
    h = hashlib.sha256()
    for p in names:
        h.update(f"{p.name}:{_cached_file_sha256(p, cache)}\n".encode())
    return h.hexdigest()


def tensors_digest(weights: dict) -> str:
    """Content digest of in-memory weights (an engine built from a weights dict)."""
    h = hashlib.sha256()
    for name in sorted(weights):
        t = weights[name]
        if isinstance(t, torch.Tensor):
            h.update(f"{name}:{t.dtype}:{tuple(t.shape)}\n".encode())
            h.update(t.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
        else:
            h.update(f"{name}:{t!r}\n".encode())
    return h.hexdigest()


def fingerprint(*, weights: str, dtype: str, weight_formats: dict, device: str, spec,
                kv_format_json: str, outliers: torch.Tensor | None, block_size: int,
                tp_size: int, tp_rank: int) -> str:
    """The hex sha256 of every field that changes the stored bytes (module docstring)."""
    rope = {"theta": spec.rope.theta, "scaling": spec.rope.scaling,
            "local_base": spec.rope.local_base_freq, "partial": spec.rope.partial_rotary_factor,
            "rotary_dim": spec.rotary_dim}
    if spec.rope.position_embedding_type != "rope":  # only then: other fingerprints unchanged
        rope["position_embedding_type"] = spec.rope.position_embedding_type
    outlier_digest = (None if outliers is None else hashlib.sha256(
        outliers.contiguous().numpy().tobytes()).hexdigest())
    fields = {"version": FORMAT_VERSION, "weights": weights, "dtype": dtype,
              "weight_formats": weight_formats, "device": device, "rope": rope,
              "kv_format": json.loads(kv_format_json), "outliers": outlier_digest,
              "block_size": block_size, "tp_size": tp_size, "tp_rank": tp_rank,
              "layer_groups": [sorted(set(spec.layers.types))]}
    if spec.mup is not None or spec.attention.multiplier is not None:
        fields["mup"] = [spec.mup, spec.attention.multiplier]
    raw = json.dumps(fields, sort_keys=True, default=str).encode()
    return hashlib.sha256(raw).hexdigest()
