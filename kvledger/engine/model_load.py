"""What an engine loads before it builds anything: the compute dtype, the model's id and
spec, and its weights and tokenizer (``model/weights/loader.py``; dummy weights at a
catalogue config's shapes, refused before they are made when they and the KV pool exceed the
available memory, ``kv/pool_size.check_memory``); and the model built of them on the device with
its attention backend (:func:`build_model`).
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from kvledger.device import resolve
from kvledger.device.placement import place
from kvledger.engine.attention import make_backend
from kvledger.engine.attention.layer import layers_of
from kvledger.engine.config import EngineConfig
from kvledger.engine.kv.pool_size import check_memory
from kvledger.engine.tuning.tuned import TunedDevice
from kvledger.errors import InvalidParameterError
from kvledger.model.families import model_class
from kvledger.spec import ModelSpec

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
log = logging.getLogger("kvledger.engine")


def compute_dtype(name: str) -> torch.dtype:
    """The activation (compute) dtype called ``name`` (:data:`DTYPES`).

    Raises:
        InvalidParameterError: an unknown name.
    """
    if name not in DTYPES:
        raise InvalidParameterError(f"dtype must be one of {', '.join(sorted(DTYPES))}, "
                                    f"got {name!r}")
    return DTYPES[name]


def build_model(spec: ModelSpec, weights: dict, dtype: torch.dtype,
                attention: str | None = None, formats: dict[str, str] | None = None,
                device: TunedDevice | None = None):
    """The model of ``spec``'s family (:func:`kvledger.model.families.model_class`) on
    ``device`` (the engine's tuned device; None: the CPU's), with the attention backend named
    ``attention`` (None: the device's choice) given the spec's per-layer parameters; on a
    device other than the CPU, built on the CPU and placed in its memory
    (``kvledger.device.placement``).

    Raises:
        UnsupportedModelError: as ``model_class``.
    """
    cls = model_class(spec)
    device = device or TunedDevice(resolve("cpu"))
    backend = make_backend(attention or device.attention_backend(spec), device.kernels)
    backend.set_layers(layers_of(spec))
    model = cls(spec, weights, dtype, device=device, attention=backend, formats=formats)
    if device.name != "cpu":  # built on the CPU, then its tensors go to the device's memory
        place(model, device.torch_device)
    return model


def model_name(model: str, load_format: str = "auto") -> str:
    """The id clients use (``paths.model_id`` of the resolved path; a catalogue id as given
    under dummy weights)."""
    from kvledger.paths import model_id, resolve_model_path

    if load_format == "dummy" and model != "default" and not Path(model).expanduser().exists():
        return model
    return model_id(resolve_model_path(model))


def model_spec(config: EngineConfig) -> ModelSpec:
    """The spec of ``config.model``, read without its weights (a catalogue id under dummy
    weights)."""
    from kvledger.model.families import load_spec

    if config.load_format == "dummy":
        from kvledger.model.weights.dummy import dummy_spec

        return dummy_spec(config.model)
    return load_spec(config.model)


def load_model(config: EngineConfig, dtype: torch.dtype):
    """(spec, weights, tokenizer, tokenizer note) of ``config.model``; the note says which
    tokenizer stands in for a dummy model without one (else None).

    Raises:
        ModelNotFoundError, ConfigError, UnsupportedModelError: the model cannot be loaded.
        KVBudgetError: dummy weights and the KV pool exceed the available memory.
    """
    from kvledger.model.weights.loader import load_tokenizer, load_weights

    if config.load_format != "dummy":
        model_class(model_spec(config))  # refused by name before any weight is looked for
        spec, weights = load_weights(config.model, dtype)
        return spec, weights, load_tokenizer(config.model), None
    from kvledger.model.weights.loader import load_tokenizer_or_bundled

    spec = model_spec(config)
    model_class(spec)  # an engine family, or refused by name
    check_memory(config, spec, dtype)
    tokenizer, note = load_tokenizer_or_bundled(config.model)
    if note:
        log.warning("%s", note)
    return (*load_weights(config.model, dtype, "dummy"), tokenizer, note)
