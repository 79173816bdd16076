"""ModelSpec from a Hugging Face ``config.json``, through the family that reads its
``model_type`` (a :class:`~kvledger.spec.family.Family` of the table given).

The generic path reads what every decoder has (layers, heads, sizes, RoPE in transformers 4 or 5
spellings, token ids, dtype, attention / MLP biases); the family gives the other spellings of
its keys, its defaults, its fields beyond the Llama defaults and its rule for placing sliding
layers. A ``model_type`` no family reads goes through the generic path with a
:class:`ConfigWarning`.

Invariants:
  * ``head_dim`` is the config's ``head_dim`` when present, else hidden / heads (Qwen3, Gemma
    and gpt-oss set it explicitly and differ from hidden / heads).
  * Keys a config may omit take the default of the transformers config class of its family
    (e.g. ``num_key_value_heads`` = ``num_attention_heads``, Gemma ties embeddings); a required
    key that is missing raises :class:`ConfigError` naming the key and the file.
  * ``layer_types`` from the config wins over the family's rule for placing sliding layers.
  * An unknown family ties embeddings unless the config says otherwise (the
    ``PretrainedConfig`` default); a known one unties them unless its defaults say otherwise.
"""

from __future__ import annotations

import warnings
from pathlib import Path

from kvledger.errors import ConfigError
from kvledger.paths import model_id
from kvledger.spec.config import Config, merged, read_config
from kvledger.spec.family import Family, FamilyTable
from kvledger.spec.groups import CONV, FULL, LINEAR, MAMBA, SLIDING
from kvledger.spec.model_spec import ModelSpec


class ConfigWarning(UserWarning):
    """A config was read with a guess (unknown ``model_type``, generic path)."""


_TORCH_DTYPES = {"float32": "fp32", "float16": "fp16", "bfloat16": "bf16"}
_LAYER_KINDS = (FULL, SLIDING, LINEAR, CONV, MAMBA)


def spec_from_hf_config(path: str | Path, families: FamilyTable) -> ModelSpec:
    """Read a Hugging Face ``config.json`` (or a folder holding one) into a ModelSpec.

    Raises:
        ConfigError: not JSON, truncated, or a required key is missing (the message names the
            key and the file).
    Warns:
        ConfigWarning: no family of ``families`` reads the ``model_type`` (generic path).
    """
    path = Path(path)
    if path.is_dir():
        path = path / "config.json"
    cfg = merged(read_config(path))
    model_type = str(cfg.get("model_type") or "")
    family = families.of_type(model_type)
    if family is None:
        warnings.warn(
            f"{path}: model_type {model_type or '(none)'!r} is not a known family; read with "
            "the generic llama-style path (check the KV figures)",
            ConfigWarning,
            stacklevel=2,
        )
        c = Config(cfg, path)
    else:
        model_type = family.aliases.get(model_type, model_type)
        cfg = family.config_prepare(cfg) | {"model_type": model_type}
        c = Config(cfg, path, family.config_defaults.get(model_type, {}))
    fields = _common_fields(c, path, known=family is not None)
    if family is not None:
        fields.update(family.config_fields(c, fields["num_layers"]))
    if "layer_types" not in fields:
        fields["layer_types"] = _layer_types(c, fields["num_layers"], family)
    if SLIDING in fields["layer_types"]:
        fields["sliding_window"] = c.int("sliding_window")
    return ModelSpec.from_fields(**fields)


def _common_fields(c: Config, path: Path, known: bool) -> dict:
    heads = c.int("num_attention_heads")
    hidden = c.int("hidden_size")
    eos = c.get("eos_token_id")
    quant = c.get("quantization_config") or {}
    dtype = c.get("torch_dtype") or c.get("dtype") or "bfloat16"
    return {
        "name": model_id(path),
        "model_type": c.model_type or "unknown",
        "num_layers": c.int("num_hidden_layers"),
        "hidden_size": hidden,
        "num_attention_heads": heads,
        "num_kv_heads": int(c.get("num_key_value_heads", heads)),
        "head_dim": int(c.get("head_dim") or (hidden // heads if heads else 0)),
        "intermediate_size": c.int("intermediate_size"),
        "vocab_size": c.int("vocab_size"),
        "max_position_embeddings": c.int("max_position_embeddings"),
        "tie_word_embeddings": bool(c.get("tie_word_embeddings", not known)),
        "rms_norm_eps": _number(c, "rms_norm_eps", c.get("rms_norm_eps",
                                                          c.get("layer_norm_eps", 1e-5))),
        **_rope_fields(c),
        # Gemma's MLP reads hidden_activation first (transformers' Gemma2MLP)
        "hidden_act": str(c.get("hidden_activation") or c.get("hidden_act")
                          or c.get("activation_function") or "silu"),
        "bos_token_id": c.get("bos_token_id"),
        "eos_token_ids": tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,)),
        "qkv_bias": bool(c.get("attention_bias", False)),
        "o_bias": bool(c.get("attention_bias", False)),
        "mlp_bias": bool(c.get("mlp_bias", False)),
        "weights_dtype": "fp8"
        if quant.get("quant_method") == "fp8"
        else _TORCH_DTYPES.get(str(dtype), "bf16"),
        "source": str(path),
    }


_ROPE_KEYS_NOT_SCALING = ("rope_theta", "partial_rotary_factor")


def _rope_fields(c: Config) -> dict:
    """RoPE base, scaling, local base and rotary share, from transformers 4's top-level keys
    (``rope_theta``, ``rope_scaling``, ``rope_local_base_freq``, ``partial_rotary_factor``,
    ``original_max_position_embeddings``) or transformers 5's ``rope_parameters`` (one dict,
    or one per layer kind, ``full_attention`` / ``sliding_attention``, for Gemma 3).

    ``rope_scaling`` comes out with ``rope_type`` (``type`` renamed, LongRoPE's old name
    ``su`` -> ``longrope``) and the pre-scaling context, None for the default type."""
    params = c.object("rope_parameters")
    by_kind = any(k in params for k in (FULL, SLIDING))
    full = (params.get(FULL) or {}) if by_kind else params
    local = (params.get(SLIDING) or {}) if by_kind else {}
    theta = full.get("rope_theta", c.get("rope_theta", 10000.0))
    scaling = dict(c.object("rope_scaling") or {k: v for k, v in full.items()
                                            if k not in _ROPE_KEYS_NOT_SCALING})
    kind = scaling.pop("type", None)
    kind = scaling.setdefault("rope_type", kind or "default")
    if kind == "su":
        scaling["rope_type"] = "longrope"
    if c.get("original_max_position_embeddings") is not None:
        scaling.setdefault("original_max_position_embeddings",
                           c.get("original_max_position_embeddings"))
    local_theta = local.get("rope_theta", c.get("rope_local_base_freq"))
    return {
        "rope_theta": _number(c, "rope_theta", theta),
        "rope_scaling": None if scaling["rope_type"] == "default" else scaling,
        "rope_local_base_freq": None if local_theta is None
        else _number(c, "rope_local_base_freq", local_theta),
        "partial_rotary_factor": _number(c, "partial_rotary_factor", full.get(
            "partial_rotary_factor", c.get("partial_rotary_factor", 1.0))),
    }


def _number(c: Config, key: str, value) -> float:
    """``value`` of ``key`` as a float; a ConfigError naming the key when it is no number (its
    range is checked with the spec's, ``spec/ranges.py``)."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ConfigError(f"{c.path}: {key!r} must be a number, got {value!r}")
    return float(value)


def _layer_types(c: Config, n: int, family: Family | None) -> tuple[str, ...]:
    """Per-layer kinds: the config's ``layer_types``, else the family's placement rule, else
    every layer full."""
    explicit = c.get("layer_types")
    if explicit is not None:
        bad = sorted(set(explicit) - set(_LAYER_KINDS))
        if len(explicit) != n or bad:
            raise ConfigError(
                f"{c.path}: 'layer_types' must list {n} kinds from {_LAYER_KINDS}, "
                f"got {bad or len(explicit)}"
            )
        return tuple(explicit)
    placed = None if family is None else family.layer_types(c, n)
    return (FULL,) * n if placed is None else placed
