"""The model families: one module per family, each declaring one :class:`kvledger.spec.Family`
(``FAMILY``) that owns everything that is the family's: how its ``config.json`` (transformers 4
and 5 spellings) and GGUF metadata map to the spec, its weight and GGUF tensor names, what its
forward runs (or, for a family `kvledger plan` sizes and the engine refuses, what it is), and
its forward class, built on first use from the shared layers (``kvledger.model.layers``).

The registry below lists the modules once; the generic readers of ``kvledger.spec`` and the
weight loader look families up in it. Torch-free on import: `kvledger plan` and
:func:`load_spec` run without an ML stack.

A family's model is built as ``model_class(spec)(spec, weights, dtype, *, device, attention,
formats=None)``: ``device`` a ``kvledger.device.Device`` (its weight formats, GEMM paths,
fused ops and kernels), ``attention`` an attention backend whose per-layer parameters the
engine has set; the model offers what the engine reads: ``forward`` and ``compute_logits``,
``rope``, ``attention``, ``dtype``, ``weight_formats`` and ``decode_weight_bytes``.
"""

from __future__ import annotations

from pathlib import Path

from kvledger.model.families import (
    deepseek,
    deepseek_v3,
    gemma,
    gpt2,
    gpt_neox,
    gpt_oss,
    granitehybrid,
    lfm2,
    llama,
    moe,
    olmo3,
    phi3,
    qwen2_moe,
    qwen3,
    qwen3_5,
    qwen3_next,
)
from kvledger.spec import Family, FamilyTable, ModelSpec, read_spec
from kvledger.spec import check_runnable as check_family
from kvledger.spec import spec_from_gguf as read_gguf
from kvledger.spec import spec_from_gguf_reader as read_gguf_header
from kvledger.spec import spec_from_hf_config as read_hf_config

FAMILIES = FamilyTable([
    llama.FAMILY,
    qwen3.FAMILY,
    phi3.FAMILY,
    gemma.FAMILY,
    moe.FAMILY,
    gpt_oss.FAMILY,
    deepseek.FAMILY,
    olmo3.FAMILY,
    deepseek_v3.FAMILY,
    qwen2_moe.FAMILY,
    qwen3_next.FAMILY,
    qwen3_5.FAMILY,
    lfm2.FAMILY,
    granitehybrid.FAMILY,
    gpt2.FAMILY,
    gpt_neox.FAMILY,
])
"""Every family the readers know; the engine runs those with a forward."""
ENGINE_MODEL_TYPES = FAMILIES.engine_model_types
"""The ``model_type`` values whose decoder the engine runs (others are sized by `kvledger
plan` only)."""
GGUF_MODEL_TYPES = FAMILIES.gguf_model_types
"""GGUF ``general.architecture`` -> the ``model_type`` it is read as."""


def load_spec(model: str | Path) -> ModelSpec:
    """The spec of ``"default"``, a ``.gguf`` file, a ``config.json`` file, or a folder holding
    a ``config.json`` (preferred) or a ``.gguf`` file (:func:`kvledger.spec.read_spec`).

    Raises:
        ModelNotFoundError, ConfigError, UnsupportedModelError: as ``read_spec``.
    """
    return read_spec(model, FAMILIES)


def spec_from_hf_config(path: str | Path) -> ModelSpec:
    """The spec of a ``config.json`` (or a folder holding one), read by its family."""
    return read_hf_config(path, FAMILIES)


def spec_from_gguf(path: str | Path) -> ModelSpec:
    """The spec of a ``.gguf`` file, read by the family of its architecture."""
    return read_gguf(path, FAMILIES)


def spec_from_gguf_reader(reader, path: Path) -> ModelSpec:
    """:func:`spec_from_gguf` for an already open ``GGUFReader`` of the file at ``path``."""
    return read_gguf_header(reader, path, FAMILIES)


def check_runnable(spec: ModelSpec) -> str:
    """Refuse a spec the engine would not compute exactly; return its family's name.

    Raises:
        UnsupportedModelError: as :func:`kvledger.spec.check_runnable`.
    """
    return check_family(spec, FAMILIES)


def family_of(spec: ModelSpec) -> Family | None:
    """The family that reads ``spec`` (a GGUF's: the family of its architecture, whose tensor
    names it has), None for a ``model_type`` no family reads."""
    arch = spec.extra.get("gguf_architecture")
    return FAMILIES.of_arch(arch) if arch else FAMILIES.of_type(spec.model_type)


def model_class(spec: ModelSpec) -> type:
    """The forward class that runs ``spec``, once :func:`check_runnable` passes.

    Raises:
        UnsupportedModelError: as :func:`check_runnable`.
    """
    check_runnable(spec)
    return FAMILIES.of_type(spec.model_type).model()
