"""A model family as the generic readers see it: the descriptor each family module of
``kvledger.model.families`` declares, and the table the readers look families up in.

A :class:`Family` holds everything that is one family's and not one format's: the
``config.json`` ``model_type`` values it reads, their defaults and other spellings, the fields
beyond the Llama defaults and the rule that places sliding layers; the GGUF architectures it
reads, their metadata and tensor names; the field values its forward runs beyond the plain
Llama decoder's (``kvledger.spec.runnable``), or, for a family the engine does not run, what
it is; and, lazily, its weight renames and its forward class. The readers
(:mod:`.hf_config`, :mod:`.gguf_reader`) and the checker take a :class:`FamilyTable` as a
parameter, so this package never imports the families (they sit above it, in
``kvledger.model``). Torch-free: a family's torch code is behind :attr:`Family.model`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from kvledger.spec.config import Config
from kvledger.spec.model_spec import ModelSpec


def _nothing(*args: Any) -> dict:
    return {}


def _no_rule(c: Config, n: int) -> None:
    return None


@dataclass(frozen=True)
class Family:
    """One family's descriptor (module docstring).

    Attributes:
        name: the family's name (its module of ``kvledger.model.families``).
        model_types: the ``config.json`` ``model_type`` values it reads.
        runs: field -> the values its forward runs where they differ from
            ``kvledger.spec.runnable.ONLY_AT``; None for a family the engine does not run.
        what: for a family the engine does not run, what it is (the refusal names it).
        aliases: a ``model_type`` -> the one it is read as (a multimodal wrapper's decoder).
        config_prepare: the merged config dict -> the same in the Hugging Face spellings the
            generic path reads (GPT-2's ``n_head``), keys derived from others filled in.
        config_defaults: per ``model_type``, the transformers config class's defaults of the
            keys a config may omit.
        config_fields: ``(config, num_layers) -> fields`` beyond the Llama defaults.
        layer_types: ``(config, num_layers) -> kinds``, the family's rule for placing sliding
            (or linear) layers when the config lists none; None: every layer full.
        gguf_archs: GGUF ``general.architecture`` -> the ``model_type`` read.
        gguf_fields: ``(header, fields) -> fields`` a GGUF file of the family sets beyond the
            generic reader's (``kvledger.spec.gguf_reader.GGUFHeader``).
        gguf_sliding_period: per architecture, llama.cpp's default period of sliding layers
            (the last of each period is full) when the file lists none.
        gguf_tensors: a GGUF block tensor -> its Hugging Face name, beyond the Llama ones.
        gguf_rope_permuted: the architectures whose attn_q / attn_k rows llama.cpp's converter
            permuted for ggml's interleaved RoPE.
        gguf_norm_plus_one: the converter stores norm weights as ``1 + w``.
        gguf_kquant_blocks: K-quant matrices are held as the file's blocks (checked against
            the dequantized file); else dequantized at load.
        weight_names: ``(state, spec) -> None``, renames and splits a checkpoint's tensors in
            place into the common names (``kvledger.model.weights.names``).
        tensor_shapes: ``(spec, shapes) -> shapes``, the common tensors a model of the family
            holds where they differ from the generic list.
        norm_offset: added to every RMSNorm weight as loaded (Gemma's ``1 + w``: 1).
        model: ``() -> class`` of the forward pass (imports torch when called).
    """

    name: str
    model_types: tuple[str, ...]
    runs: Mapping[str, Callable[[Any], bool]] | None = None
    what: str = ""
    aliases: Mapping[str, str] = field(default_factory=dict)
    config_prepare: Callable[[dict], dict] = dict
    config_defaults: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)
    config_fields: Callable[[Config, int], dict] = _nothing
    layer_types: Callable[[Config, int], tuple[str, ...] | None] = _no_rule
    gguf_archs: Mapping[str, str] = field(default_factory=dict)
    gguf_fields: Callable[[Any, dict], dict] = _nothing
    gguf_sliding_period: Mapping[str, int] = field(default_factory=dict)
    gguf_tensors: Mapping[str, str] = field(default_factory=dict)
    gguf_rope_permuted: frozenset[str] = frozenset()
    gguf_norm_plus_one: bool = False
    gguf_kquant_blocks: bool = False
    weight_names: Callable[[dict, ModelSpec], None] = _nothing
    tensor_shapes: Callable[[ModelSpec, dict], dict] = lambda spec, shapes: shapes
    norm_offset: float = 0.0
    model: Callable[[], type] | None = None

    @property
    def runs_in_engine(self) -> bool:
        """Whether the engine runs the family (it has a forward and the values it runs)."""
        return self.runs is not None and self.model is not None


class FamilyTable:
    """The families the readers know, looked up by ``model_type`` or GGUF architecture.

    Raises:
        ValueError: two families claim one ``model_type`` or GGUF architecture.
    """

    def __init__(self, families: Iterable[Family]) -> None:
        self.families = tuple(families)
        self._by_type: dict[str, Family] = {}
        self._by_arch: dict[str, Family] = {}
        for family in self.families:
            for model_type in (*family.model_types, *family.aliases):
                _claim(self._by_type, model_type, family)
            for arch in family.gguf_archs:
                _claim(self._by_arch, arch, family)

    def of_type(self, model_type: str) -> Family | None:
        """The family that reads ``model_type`` (or an alias of it), None when none does."""
        return self._by_type.get(model_type)

    def of_arch(self, arch: str) -> Family | None:
        """The family that reads GGUF architecture ``arch``, None when none does."""
        return self._by_arch.get(arch)

    @property
    def engine_model_types(self) -> tuple[str, ...]:
        """The ``model_type`` values whose decoder the engine runs, in table order."""
        return tuple(t for f in self.families if f.runs_in_engine for t in f.model_types)

    @property
    def gguf_model_types(self) -> dict[str, str]:
        """GGUF architecture -> the ``model_type`` read, over every family."""
        return {arch: t for f in self.families for arch, t in f.gguf_archs.items()}


def _claim(table: dict[str, Family], key: str, family: Family) -> None:
    """``table[key] = family``, unless another family holds ``key``.

    Raises:
        ValueError: two families claim ``key``.
    """
    if key in table:
        raise ValueError(f"{key!r} is claimed by {table[key].name} and {family.name}")
    table[key] = family
