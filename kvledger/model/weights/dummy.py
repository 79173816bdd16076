"""``--load-format dummy`` (vLLM's name): weights at the exact shapes of a model, with no
checkpoint, to run and time any architecture the engine has from its config alone.

The model is a folder or file with a config (as ``load_spec`` reads it), or a Hugging Face id of
the catalogue (``kvledger models``). Every tensor of :func:`.names.tensor_shapes` is drawn
uniform in [-1e-3, 1e-3] from a generator seeded with :data:`SEED` (the same weights on every
tensor-parallel rank and every run); RMSNorm weights are the identity: 1, or 0 in Gemma's
``(1 + w)`` form (the family's ``norm_offset``). The tokenizer is the model's own when its
folder has one, else the bundled model's, which the caller is told
(:func:`kvledger.model.weights.loader.load_tokenizer_or_bundled`).
"""

from __future__ import annotations

from pathlib import Path

import torch

from kvledger.model.weights.names import is_norm, tensor_shapes
from kvledger.spec import Family, ModelSpec

SEED = 0
BOUND = 1e-3
BUNDLED_TOKENIZER_NOTE = ("tokenizer: the bundled SmolLM2-135M-Instruct's (the model's own is "
                          "absent)")


def dummy_spec(model: str) -> ModelSpec:
    """The spec of ``model``: an existing path's config, else the catalogue's config of that
    Hugging Face id.

    Raises:
        ModelNotFoundError: neither a path nor a catalogue id (the closest ids are named).
        ConfigError: the config is malformed.
    """
    import dataclasses

    from kvledger.model.catalogue import catalogue_spec, lookup
    from kvledger.model.families import load_spec

    if model == "default" or Path(model).expanduser().exists():
        return load_spec(model)
    entry = lookup(model)
    return dataclasses.replace(catalogue_spec(entry), source=str(entry.path))


def dummy_weights(spec: ModelSpec, dtype: torch.dtype, family: Family,
                  device: torch.device | str = "cpu") -> dict:
    """Seeded weights of ``spec`` (of ``family``) in ``dtype`` (module docstring); norms
    ``1 - family.norm_offset``; drawn on ``device`` by its own generator (a GPU draws an 8B
    model in a moment; its numbers are not the CPU's)."""
    g = torch.Generator(device=device).manual_seed(SEED)
    out = {}
    for name, shape in tensor_shapes(spec, family).items():
        if is_norm(name):
            out[name] = torch.full(shape, 1.0 - family.norm_offset, dtype=dtype, device=device)
        else:
            out[name] = torch.empty(shape, dtype=dtype, device=device).uniform_(
                -BOUND, BOUND, generator=g)
    return out
