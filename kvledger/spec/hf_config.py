"""ModelSpec from a Hugging Face ``config.json``.

Reads the architecture numbers of every family the ledger knows: llama, mistral (uniform
``sliding_window``), mixtral, qwen2/2.5 and qwen3 (``use_sliding_window: false`` means no window),
qwen2_moe / qwen3_moe, qwen3_next (a full-attention layer every ``full_attention_interval``, Gated
DeltaNet linear attention elsewhere), gemma2 / gemma3 / gemma3_text (interleaved local/global
layers; multimodal configs nest the decoder under ``text_config``), gpt_oss (``layer_types``;
learned sinks store no KV), deepseek_v2 / deepseek_v3 / kimi_k2 (MLA), phi3, gpt2 (``n_head`` /
``n_embd``) and gpt_neox. Any other ``model_type`` with the standard keys goes through the same
path with a :class:`ConfigWarning`.

Invariants:
  * ``head_dim`` is the config's ``head_dim`` when present, else hidden / heads (Qwen3, Gemma
    and gpt-oss set it explicitly and differ from hidden / heads).
  * Keys a config may omit take the default of the transformers config class of its family
    (e.g. ``num_key_value_heads`` = ``num_attention_heads``, Gemma ties embeddings); a required
    key that is missing raises :class:`ConfigError` naming the key and the file.
  * ``layer_types`` from the config wins over the family's rule for placing sliding layers.
  * A missing or null ``q_lora_rank`` means no query compression (DeepSeek-V2-Lite's upstream
    config has ``null``); an unknown family ties embeddings unless the config says otherwise
    (the ``PretrainedConfig`` default).

Layer placement rules follow the transformers configuration classes (v4.57 / v5):
Qwen2 ``i >= max_window_layers`` slide when ``use_sliding_window``; Gemma2 even layers slide;
Gemma3 every layer but each ``sliding_window_pattern``-th slides; Qwen3-Next layer ``i`` is full
attention when ``(i + 1) % full_attention_interval == 0``.
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path

from kvledger.errors import ConfigError
from kvledger.paths import model_id
from kvledger.spec.groups import FULL, LINEAR, MLA, SLIDING
from kvledger.spec.model_spec import ModelSpec


class ConfigWarning(UserWarning):
    """A config was read with a guess (unknown ``model_type``, generic path)."""


_TORCH_DTYPES = {"float32": "fp32", "float16": "fp16", "bfloat16": "bf16"}
_LAYER_KINDS = (FULL, SLIDING, LINEAR)
_GPT2_KEYS = {
    "n_layer": "num_hidden_layers",
    "n_embd": "hidden_size",
    "n_head": "num_attention_heads",
    "n_positions": "max_position_embeddings",
    "n_inner": "intermediate_size",
    "layer_norm_epsilon": "rms_norm_eps",
}
# transformers config-class defaults for keys real configs omit (only keys with a fixed default)
_DEFAULTS = {
    "gemma2": {"tie_word_embeddings": True, "hidden_activation": "gelu_pytorch_tanh",
               "query_pre_attn_scalar": 256, "attn_logit_softcapping": 50.0,
               "final_logit_softcapping": 30.0, "rms_norm_eps": 1e-6, "bos_token_id": 2,
               "eos_token_id": 1},
    "gemma3_text": {
        "tie_word_embeddings": True,
        "rms_norm_eps": 1e-6,
        "bos_token_id": 2,
        "eos_token_id": 1,
        "hidden_activation": "gelu_pytorch_tanh",
        "query_pre_attn_scalar": 256,
        "rope_local_base_freq": 10_000.0,
        "num_attention_heads": 8,
        "num_key_value_heads": 4,
        "head_dim": 256,
        "vocab_size": 262208,
        "max_position_embeddings": 131072,
        "sliding_window": 4096,
        "sliding_window_pattern": 6,
        "rope_theta": 1_000_000.0,
    },
    "gpt2": {"tie_word_embeddings": True},
    "gpt_neox": {"attention_bias": True, "layer_norm_eps": 1e-5},
}
KNOWN_TYPES = frozenset(
    [
        "llama",
        "mistral",
        "mixtral",
        "qwen2",
        "qwen2_moe",
        "qwen3",
        "qwen3_moe",
        "qwen3_next",
        "gemma2",
        "gemma3",
        "gemma3_text",
        "gpt_oss",
        "deepseek_v2",
        "deepseek_v3",
        "kimi_k2",
        "phi3",
        "gpt2",
        "gpt_neox",
    ]
)


def read_config(path: Path) -> dict:
    """Parse a config.json file into a dict.

    Raises:
        ConfigError: unreadable, not JSON (or truncated), or not a JSON object.
    """
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ConfigError(f"{path} is not valid JSON (truncated or corrupt?): {exc}") from None
    except OSError as exc:
        raise ConfigError(f"cannot read {path}: {exc.strerror}") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"{path} is not a JSON object of config keys")
    return raw


class _Config:
    """A config dict with the family's defaults applied and errors that name the file."""

    def __init__(self, raw: dict, path: Path):
        self.path = path
        nested = raw.get("text_config")
        cfg = {**raw, **nested} if isinstance(nested, dict) else dict(raw)
        if cfg.get("model_type") == "gemma3":  # multimodal wrapper: the decoder is gemma3_text
            cfg["model_type"] = "gemma3_text"
        self.model_type = str(cfg.get("model_type") or "")
        if self.model_type == "gpt2":
            cfg = {_GPT2_KEYS.get(k, k): v for k, v in cfg.items()}
            if cfg.get("intermediate_size") is None and "hidden_size" in cfg:
                cfg["intermediate_size"] = 4 * cfg["hidden_size"]
        defaults = _DEFAULTS.get(self.model_type, {})
        self.cfg = {**defaults, **{k: v for k, v in cfg.items() if v is not None}}

    def req(self, key: str):
        """Value of a required key; ConfigError naming the key and file when absent."""
        if key not in self.cfg:
            raise ConfigError(f"{self.path} lacks the required key {key!r}")
        return self.cfg[key]

    def get(self, key: str, default=None):
        return self.cfg.get(key, default)

    def object(self, key: str) -> dict:
        """Value of an optional JSON object key ({} when absent or null)."""
        value = self.get(key) or {}
        if not isinstance(value, dict):
            raise ConfigError(f"{self.path}: {key!r} must be an object, got {value!r}")
        return value

    def int(self, key: str) -> int:
        value = self.req(key)
        if not isinstance(value, int) or isinstance(value, bool):
            raise ConfigError(f"{self.path}: {key!r} must be an integer, got {value!r}")
        return value


def spec_from_hf_config(path: str | Path) -> ModelSpec:
    """Read a Hugging Face ``config.json`` (or a folder holding one) into a ModelSpec.

    Raises:
        ConfigError: not JSON, truncated, or a required key is missing (the message names the
            key and the file).
    Warns:
        ConfigWarning: the ``model_type`` is not one of :data:`KNOWN_TYPES` (generic path).
    """
    path = Path(path)
    if path.is_dir():
        path = path / "config.json"
    c = _Config(read_config(path), path)
    mt = c.model_type
    if mt not in KNOWN_TYPES:
        warnings.warn(
            f"{path}: model_type {mt or '(none)'!r} is not a known family; read with the "
            "generic llama-style path (check the KV figures)",
            ConfigWarning,
            stacklevel=2,
        )
    fields = _common_fields(c, path)
    fields.update(_family_fields(c, fields["num_layers"]))
    if "layer_types" not in fields:
        fields["layer_types"] = _layer_types(c, fields["num_layers"])
    if SLIDING in fields["layer_types"]:
        fields["sliding_window"] = c.int("sliding_window")
    return ModelSpec.from_fields(**fields)


def _common_fields(c: _Config, path: Path) -> dict:
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
        "tie_word_embeddings": bool(c.get("tie_word_embeddings", c.model_type not in KNOWN_TYPES)),
        "rms_norm_eps": float(c.get("rms_norm_eps", c.get("layer_norm_eps", 1e-5))),
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


def _rope_fields(c: _Config) -> dict:
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
        "rope_theta": float(theta),
        "rope_scaling": None if scaling["rope_type"] == "default" else scaling,
        "rope_local_base_freq": None if local_theta is None else float(local_theta),
        "partial_rotary_factor": float(full.get("partial_rotary_factor",
                                                c.get("partial_rotary_factor", 1.0))),
    }


def _layer_types(c: _Config, n: int) -> tuple[str, ...]:
    """Per-layer kinds: the config's ``layer_types`` or the family's placement rule."""
    explicit = c.get("layer_types")
    if explicit is not None:
        bad = sorted(set(explicit) - set(_LAYER_KINDS))
        if len(explicit) != n or bad:
            raise ConfigError(
                f"{c.path}: 'layer_types' must list {n} kinds from {_LAYER_KINDS}, "
                f"got {bad or len(explicit)}"
            )
        return tuple(explicit)
    mt = c.model_type
    if mt in ("mistral", "mixtral", "phi3") and c.get("sliding_window"):
        return (SLIDING,) * n
    if mt.startswith("qwen") and mt != "qwen3_next" and c.get("use_sliding_window", False):
        # transformers' Qwen3-MoE slides every layer (it has no max_window_layers)
        first = 0 if mt == "qwen3_moe" else int(c.get("max_window_layers", 0))
        return tuple(SLIDING if i >= first else FULL for i in range(n))
    if mt in ("gemma2", "gpt_oss"):
        return tuple(SLIDING if (i + 1) % 2 else FULL for i in range(n))
    if mt == "gemma3_text":
        pattern = int(c.req("sliding_window_pattern"))
        return tuple(SLIDING if (i + 1) % pattern else FULL for i in range(n))
    if mt == "qwen3_next":
        every = int(c.req("full_attention_interval"))
        return tuple(FULL if (i + 1) % every == 0 else LINEAR for i in range(n))
    return (FULL,) * n


def _family_fields(c: _Config, n: int) -> dict:
    """Fields that differ from the Llama defaults, per family."""
    mt = c.model_type
    if mt in ("deepseek_v2", "deepseek_v3", "kimi_k2"):
        return _mla_fields(c, n)
    out: dict = {}
    if mt == "mixtral":
        out.update(num_experts=c.int(_experts_key(c)), norm_topk_prob=True,
                   moe_intermediate_size=c.int("intermediate_size"))
        out["num_experts_per_tok"] = c.int("num_experts_per_tok")
    elif mt in ("qwen2_moe", "qwen3_moe", "qwen3_next"):
        out.update(_qwen_moe_fields(c, n))
    elif mt == "gpt_oss":
        out.update(
            num_experts=c.int(_experts_key(c)),
            num_experts_per_tok=int(c.get("num_experts_per_tok") or c.req("experts_per_token")),
            moe_intermediate_size=c.int("intermediate_size"),
            router_bias=True,
            norm_topk_prob=True,
            mlp_bias=True,
            attention_sinks=True,
            swiglu_limit=float(c.get("swiglu_limit", 7.0)),  # GptOssConfig's defaults
            swiglu_alpha=float(c.get("swiglu_alpha", 1.702)),
        )
    if mt == "qwen2":
        out["qkv_bias"] = True
    if mt in ("qwen3", "qwen3_moe", "qwen3_next", "gemma3_text"):
        out["qk_norm"] = True
    if mt in ("gemma2", "gemma3_text"):
        out["norms_per_layer"] = 4
        out["query_pre_attn_scalar"] = float(c.req("query_pre_attn_scalar"))
        for key in ("attn_logit_softcapping", "final_logit_softcapping"):
            out[key] = None if c.get(key) is None else float(c.get(key))
    if mt == "qwen3_next":
        out.update(_linear_attention_fields(c), attn_output_gate=True)
    if mt in ("gpt2", "gpt_neox"):
        out.update(mlp_gated=False, mlp_bias=True, norm_bias=True, o_bias=True)
        out["qkv_bias"] = bool(c.get("attention_bias", True))
    if mt == "gpt2":
        out["position_embeddings"] = c.int("max_position_embeddings")
    return out


def _experts_key(c: _Config) -> str:
    """The key of the routed-expert count: transformers 4 writes ``num_experts`` (Qwen MoE) or
    ``num_local_experts`` (Mixtral, gpt-oss); transformers 5 writes ``num_local_experts``
    for all of them."""
    return "num_local_experts" if "num_local_experts" in c.cfg else "num_experts"


def _qwen_moe_fields(c: _Config, n: int) -> dict:
    """Qwen2-MoE / Qwen3-MoE / Qwen3-Next: experts on layers ``(i + 1) % decoder_sparse_step ==
    0`` not listed in ``mlp_only_layers``; an optional gated shared expert."""
    step = int(c.get("decoder_sparse_step", 1))
    dense_only = set(c.get("mlp_only_layers", []))
    dense = tuple(i for i in range(n) if i in dense_only or (i + 1) % step)
    shared = int(c.get("shared_expert_intermediate_size", 0))
    return {
        "num_experts": c.int(_experts_key(c)),
        "num_experts_per_tok": c.int("num_experts_per_tok"),
        "moe_intermediate_size": c.int("moe_intermediate_size"),
        "num_shared_experts": 1 if shared else 0,
        "shared_expert_intermediate_size": shared,
        "shared_expert_gate": bool(shared),
        "mlp_only_layers": dense,
        "norm_topk_prob": bool(c.get("norm_topk_prob", False)),
    }


def _mla_fields(c: _Config, n: int) -> dict:
    """DeepSeek-V2/V3, Kimi K2: MLA on every layer; ``first_k_dense_replace`` dense layers, then
    routed + shared experts every ``moe_layer_freq`` layers (arXiv:2405.04434, 2412.19437)."""
    first_k = int(c.get("first_k_dense_replace", 0))
    freq = int(c.get("moe_layer_freq", 1))
    dense = tuple(i for i in range(n) if i < first_k or i % freq)
    nope, rope = c.int("qk_nope_head_dim"), c.int("qk_rope_head_dim")
    return {
        "layer_types": (MLA,) * n,
        "head_dim": nope + rope,
        "kv_lora_rank": c.int("kv_lora_rank"),
        "q_lora_rank": int(c.get("q_lora_rank") or 0),
        "qk_rope_head_dim": rope,
        "qk_nope_head_dim": nope,
        "v_head_dim": c.int("v_head_dim"),
        "num_experts": c.int("n_routed_experts"),
        "num_experts_per_tok": c.int("num_experts_per_tok"),
        "moe_intermediate_size": c.int("moe_intermediate_size"),
        "num_shared_experts": int(c.get("n_shared_experts", 0)),
        "shared_expert_intermediate_size": c.int("moe_intermediate_size"),
        "mlp_only_layers": dense,
        "norm_topk_prob": bool(c.get("norm_topk_prob", False)),
        "router_bias": c.get("topk_method") == "noaux_tc",
        "routed_scaling_factor": float(c.get("routed_scaling_factor") or 1.0),
        "topk_method": c.get("topk_method") or "greedy",
        "n_group": int(c.get("n_group") or 0),
        "topk_group": int(c.get("topk_group") or 0),
    }


def _linear_attention_fields(c: _Config) -> dict:
    """Gated DeltaNet dims and its fixed state per layer (recurrent matrix + conv tail)."""
    kh, vh = c.int("linear_num_key_heads"), c.int("linear_num_value_heads")
    kd, vd = c.int("linear_key_head_dim"), c.int("linear_value_head_dim")
    kernel = c.int("linear_conv_kernel_dim")
    conv_dim = 2 * kh * kd + vh * vd
    return {
        "linear_num_key_heads": kh,
        "linear_num_value_heads": vh,
        "linear_key_head_dim": kd,
        "linear_value_head_dim": vd,
        "linear_conv_kernel_dim": kernel,
        "linear_state_elements": vh * kd * vd + (kernel - 1) * conv_dim,
    }
