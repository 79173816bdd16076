"""ModelSpec from a GGUF file's metadata (the architectures of :data:`GGUF_MODEL_TYPES`).

GGUF (the llama.cpp file format, https://github.com/ggml-org/ggml/blob/master/docs/gguf.md)
stores the architecture as key/value metadata named ``{arch}.<key>`` plus a list of tensor
infos (name, shape, type). This module reads only the header through the ``gguf`` package's
``GGUFReader`` (the file is memory-mapped; no tensor data is dequantized) and never imports
torch, so the planner can use it without an ML stack.

Invariants:
  * ``head_dim`` is ``{arch}.attention.key_length`` when present, else hidden / heads.
  * ``tie_word_embeddings`` is true exactly when the file has no ``output.weight`` tensor
    (llama.cpp converters drop the head when it shares the embedding matrix).
  * ``gguf_tensor_elements`` / ``gguf_tensor_bytes`` sum every tensor in the file, so the
    ledger's weight bytes for a GGUF are what the file really holds.
  * What the converter does not store follows llama.cpp's loader (``src/models/<arch>.cpp``):
    Gemma's ``query_pre_attn_scalar`` is hidden / heads for the 27B models (46 layers in
    Gemma 2, 62 in Gemma 3), else head_dim; Gemma 2 slides on even layers, Gemma 3 on all
    but every sixth, unless ``{arch}.attention.sliding_window_pattern`` lists them; Gemma 3's
    local RoPE base is ``{arch}.rope.freq_base_swa``, else 10,000; Phi-3's LongRoPE factors
    are the ``rope_factors_long`` / ``rope_factors_short`` tensors (read from the file, a few
    hundred floats); gpt-oss slides on even layers, its clamped SwiGLU is at 7.0 / 1.702, and
    its YaRN correction range is floored and ceiled (``ggml_rope_yarn_corr_dims``: HF's
    ``truncate``, which transformers' gpt-oss config turns off: the two differ slightly).
  * Experts (``{arch}.expert_count`` > 0): ``expert_used_count`` per token, each of
    ``expert_feed_forward_length`` (else ``feed_forward_length``); a layer routes when it has
    a router tensor ``blk.N.ffn_gate_inp``; the top-k weights are renormalised unless
    ``{arch}.expert_weights_norm`` is false (llama.cpp's llama and qwen3moe graphs normalise).
  * ``deepseek2`` (MLA written as MQA over the latent): :mod:`.gguf_deepseek`.
  * ``eos_token_ids`` starts with ``tokenizer.ggml.eos_token_id`` and adds
    ``tokenizer.ggml.eot_token_id`` and the chat-end tokens (``<|im_end|>``, ``<|eot_id|>``,
    ``<|end_of_text|>``) that the vocabulary contains.

Errors: a file without the GGUF magic -> ConfigError("not a GGUF file: PATH"); a missing
required key -> ConfigError naming the key and the file; an architecture outside
:data:`GGUF_MODEL_TYPES` -> UnsupportedModelError.
"""

from __future__ import annotations

import os
from pathlib import Path

from kvledger.errors import ConfigError, UnsupportedModelError
from kvledger.paths import model_id
from kvledger.spec.gguf_deepseek import deepseek2_fields
from kvledger.spec.groups import FULL, SLIDING
from kvledger.spec.model_spec import ModelSpec
from kvledger.spec.runnable import ENGINE_MODEL_TYPES

CHAT_END_TOKENS = ("<|im_end|>", "<|eot_id|>", "<|end_of_text|>", "<end_of_turn>", "<|end|>")
GGUF_MODEL_TYPES = {"llama": "llama", "mistral": "mistral", "qwen2": "qwen2", "qwen3": "qwen3",
                    "phi3": "phi3", "gemma2": "gemma2", "gemma3": "gemma3_text",
                    "qwen3moe": "qwen3_moe", "gpt-oss": "gpt_oss", "deepseek2": "deepseek_v2"}
"""GGUF ``general.architecture`` -> the Hugging Face ``model_type`` this reader reads it as
(a ``llama`` file with experts is ``mixtral``: llama.cpp's converter writes Mixtral so)."""
_GEMMA_27B_LAYERS = {"gemma2": 46, "gemma3": 62}
_SLIDING_PERIOD = {"gemma2": 2, "gemma3": 6, "gpt-oss": 2}  # llama.cpp's load_swa_pattern
# defaults
_YARN_KEYS = {"yarn_beta_fast": "beta_fast", "yarn_beta_slow": "beta_slow",
              "yarn_attn_factor": "attention_factor"}
GGUF_MAGIC = b"GGUF"


def check_gguf_magic(path: str | os.PathLike) -> None:
    """Raise ConfigError("not a GGUF file: PATH") unless the file starts with ``GGUF``."""
    with open(path, "rb") as f:
        magic = f.read(4)
    if magic != GGUF_MAGIC:
        raise ConfigError(f"not a GGUF file: {path}")


def open_gguf(path: str | os.PathLike):
    """Open a GGUF file with ``gguf.GGUFReader`` (memory-mapped, header parsed; ~1.5 s for a
    49k-token vocabulary, which the reader turns into one numpy array per string).

    Raises:
        ConfigError: the file does not start with the GGUF magic or its header is corrupt.
    """
    from gguf import GGUFReader

    path = Path(path)
    check_gguf_magic(path)
    try:
        return GGUFReader(path)
    except (ValueError, IndexError, OSError) as e:
        raise ConfigError(f"corrupt GGUF file: {path} ({e})") from e


def field_value(reader, key: str):
    """Value of metadata ``key`` (int, float, bool, str, or list of those); None if absent."""
    from gguf import GGUFValueType

    field = reader.fields.get(key)
    if field is None:
        return None

    def scalar(part, vtype):
        if vtype == GGUFValueType.STRING:
            return bytes(part).decode("utf-8", errors="replace")
        return part.tolist()[0]

    if field.types[0] == GGUFValueType.ARRAY:
        return [scalar(field.parts[i], field.types[-1]) for i in field.data]
    return scalar(field.parts[field.data[0]], field.types[0])


def _float32(value) -> float:
    """Shortest decimal of a FLOAT32 metadata value (9.99999975e-06 -> 1e-05, as in config.json)."""
    import numpy as np

    return float(str(np.float32(value)))


def _require(reader, key: str, path: Path):
    value = field_value(reader, key)
    if value is None:
        raise ConfigError(f"GGUF file {path} lacks the required key {key!r}")
    return value


def _rope_scaling(reader, arch: str) -> dict | None:
    """``{arch}.rope.scaling.*`` as an HF-style ``rope_scaling`` dict (None when absent/none)."""
    rope_type = field_value(reader, f"{arch}.rope.scaling.type")
    if rope_type in (None, "none"):
        return None
    scaling = {"rope_type": rope_type}
    factor = field_value(reader, f"{arch}.rope.scaling.factor")
    if factor is not None:
        scaling["factor"] = float(factor)
    original = field_value(reader, f"{arch}.rope.scaling.original_context_length")
    if original is not None:
        scaling["original_max_position_embeddings"] = int(original)
    for key, hf in _YARN_KEYS.items() if rope_type == "yarn" else ():
        value = field_value(reader, f"{arch}.rope.scaling.{key}")
        if value is not None:
            scaling[hf] = _float32(value)
    return scaling


def _tensor_floats(reader, name: str) -> list[float] | None:
    """The values of a small F32 tensor ``name`` as floats (None when absent)."""
    tensor = next((t for t in reader.tensors if t.name == name), None)
    return None if tensor is None else [_float32(x) for x in tensor.data.tolist()]


def _longrope(reader, arch: str, path: Path) -> dict | None:
    """Phi-3's LongRoPE as HF's ``rope_scaling`` (None when the file has no factor tensors)."""
    long, short = (_tensor_floats(reader, f"rope_factors_{k}.weight") for k in ("long", "short"))
    if long is None or short is None:
        return None
    scaling = {"rope_type": "longrope", "long_factor": long, "short_factor": short,
               "original_max_position_embeddings": int(_require(
                   reader, f"{arch}.rope.scaling.original_context_length", path))}
    factor = field_value(reader, f"{arch}.rope.scaling.attn_factor")
    if factor is not None:
        scaling["attention_factor"] = _float32(factor)
    return scaling


def _layer_kinds(reader, arch: str, num_layers: int, window) -> tuple[str, ...]:
    """Per-layer kinds: llama.cpp's ``sliding_window_pattern`` array, else its default
    period for the architecture (every layer slides when it has none)."""
    if not window:
        return (FULL,) * num_layers
    listed = field_value(reader, f"{arch}.attention.sliding_window_pattern")
    if isinstance(listed, list) and len(listed) == num_layers:
        return tuple(SLIDING if slides else FULL for slides in listed)
    period = _SLIDING_PERIOD.get(arch)
    if period is None:
        return (SLIDING,) * num_layers
    return tuple(SLIDING if i % period < period - 1 else FULL for i in range(num_layers))


def _gemma_fields(reader, arch: str, hidden: int, heads: int, head_dim: int,
                  num_layers: int) -> dict:
    """Gemma 2 / 3 fields the converter leaves to llama.cpp's loader (module docstring)."""
    def value(key: str):
        found = field_value(reader, f"{arch}.{key}")
        return None if found is None else _float32(found)

    big = num_layers == _GEMMA_27B_LAYERS[arch]
    out = {"hidden_act": "gelu_pytorch_tanh", "norms_per_layer": 4,
           "query_pre_attn_scalar": float(hidden // heads if big else head_dim),
           "attn_logit_softcapping": value("attn_logit_softcapping"),
           "final_logit_softcapping": value("final_logit_softcapping")}
    if arch == "gemma3":
        out["rope_local_base_freq"] = value("rope.freq_base_swa") or 10_000.0
    return out


def _moe_fields(reader, arch: str, num_layers: int, tensor_names: set[str]) -> dict:
    """The experts' fields of a file with ``{arch}.expert_count`` > 0 (module docstring), else
    nothing."""
    experts = int(field_value(reader, f"{arch}.expert_count") or 0)
    if not experts:
        return {}
    inter = field_value(reader, f"{arch}.expert_feed_forward_length") or field_value(
        reader, f"{arch}.feed_forward_length")
    norm = field_value(reader, f"{arch}.expert_weights_norm")
    return {"num_experts": experts,
            "num_experts_per_tok": int(field_value(reader, f"{arch}.expert_used_count") or 0),
            "moe_intermediate_size": int(inter),
            "mlp_only_layers": tuple(i for i in range(num_layers)
                                     if f"blk.{i}.ffn_gate_inp.weight" not in tensor_names),
            "norm_topk_prob": True if norm is None else bool(norm)}


def _gpt_oss_fields(tensor_names: set[str]) -> dict:
    """gpt-oss's fields the converter leaves to llama.cpp's graph (``src/models/openai-moe.cpp``:
    the clamped SwiGLU's 7.0 and 1.702 are constants there), and its biases and sinks."""
    return {"router_bias": "blk.0.ffn_gate_inp.bias" in tensor_names,
            "attention_sinks": "blk.0.attn_sinks.weight" in tensor_names,
            "mlp_bias": "blk.0.ffn_gate_exps.bias" in tensor_names,
            "swiglu_limit": 7.0, "swiglu_alpha": 1.702}


def _eos_token_ids(reader, tokens: list[str] | None) -> tuple[int, ...]:
    ids: list[int] = []
    for key in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id"):
        token_id = field_value(reader, key)
        if token_id is not None and int(token_id) not in ids:
            ids.append(int(token_id))
    for name in CHAT_END_TOKENS if tokens else ():
        if name in tokens:
            token_id = tokens.index(name)
            if token_id not in ids:
                ids.append(token_id)
    return tuple(ids)


def spec_from_gguf(path: str | os.PathLike) -> ModelSpec:
    """Read the architecture numbers of a GGUF file (the architectures of
    :data:`GGUF_MODEL_TYPES`).

    Args:
        path: a ``.gguf`` file.
    Returns:
        ModelSpec with ``source`` = the path and ``gguf_tensor_elements`` (elements) and
        ``gguf_tensor_bytes`` (bytes) summed over every tensor of the file.
    Raises:
        ConfigError: not a GGUF file, or a required key is missing.
        UnsupportedModelError: an architecture outside :data:`GGUF_MODEL_TYPES`.
    """
    path = Path(path)
    return spec_from_gguf_reader(open_gguf(path), path)


def spec_from_gguf_reader(reader, path: Path) -> ModelSpec:
    """:func:`spec_from_gguf` for an already open ``GGUFReader`` of the file at ``path``."""
    arch = _require(reader, "general.architecture", path)
    if arch not in GGUF_MODEL_TYPES:
        raise UnsupportedModelError(
            f"GGUF architecture {arch!r} in {path} is not supported (GGUF files are read for "
            f"{', '.join(GGUF_MODEL_TYPES)}; the engine runs {', '.join(ENGINE_MODEL_TYPES)})"
        )

    def req(key: str):
        return _require(reader, f"{arch}.{key}", path)

    hidden = int(req("embedding_length"))
    heads = int(req("attention.head_count"))
    kv_heads = int(field_value(reader, f"{arch}.attention.head_count_kv") or heads)
    head_dim = field_value(reader, f"{arch}.attention.key_length") or hidden // heads
    tokens = field_value(reader, "tokenizer.ggml.tokens")
    vocab = field_value(reader, f"{arch}.vocab_size") or (len(tokens) if tokens else None)
    if vocab is None:
        raise ConfigError(f"GGUF file {path} lacks {arch}.vocab_size and tokenizer.ggml.tokens")
    tensor_names = {t.name for t in reader.tensors}
    bos = field_value(reader, "tokenizer.ggml.bos_token_id")
    num_layers = int(req("block_count"))
    window = field_value(reader, f"{arch}.attention.sliding_window")
    rotary = field_value(reader, f"{arch}.rope.dimension_count")
    family = _moe_fields(reader, arch, num_layers, tensor_names)
    if arch in _GEMMA_27B_LAYERS:
        family = _gemma_fields(reader, arch, hidden, heads, int(head_dim), num_layers)
    if arch == "gpt-oss":
        family |= _gpt_oss_fields(tensor_names)
    model_type = GGUF_MODEL_TYPES[arch]
    if arch == "llama" and family.get("num_experts"):
        model_type = "mixtral"
    spec = ModelSpec.from_fields(
        **family,
        name=model_id(path),
        model_type=model_type,
        num_layers=num_layers,
        hidden_size=hidden,
        num_attention_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=int(head_dim),
        intermediate_size=int(req("feed_forward_length")),
        vocab_size=int(vocab),
        max_position_embeddings=int(req("context_length")),
        tie_word_embeddings="output.weight" not in tensor_names,
        rms_norm_eps=_float32(req("attention.layer_norm_rms_epsilon")),
        rope_theta=_float32(field_value(reader, f"{arch}.rope.freq_base") or 10000.0),
        rope_scaling=_longrope(reader, arch, path) or _rope_scaling(reader, arch),
        partial_rotary_factor=int(rotary) / int(head_dim) if rotary else 1.0,
        qkv_bias="blk.0.attn_q.bias" in tensor_names,
        o_bias="blk.0.attn_output.bias" in tensor_names,
        **({} if "mlp_bias" in family else {"mlp_bias": any(
            f"blk.0.ffn_{p}.bias" in tensor_names for p in ("gate", "up", "down"))}),
        qk_norm="blk.0.attn_q_norm.weight" in tensor_names,
        layer_types=_layer_kinds(reader, arch, num_layers, window),
        sliding_window=int(window) if window else None,
        bos_token_id=None if bos is None else int(bos),
        eos_token_ids=_eos_token_ids(reader, tokens),
        gguf_tensor_elements=sum(int(t.n_elements) for t in reader.tensors),
        gguf_tensor_bytes=sum(int(t.n_bytes) for t in reader.tensors),
        source=str(path),
        extra={
            "gguf_architecture": arch,
            "gguf_file_type": field_value(reader, "general.file_type"),
            # llama3-style RoPE scaling stored as precomputed per-dimension factors
            "rope_freqs_tensor": "rope_freqs.weight" in tensor_names,
        },
    )
    if arch != "deepseek2":
        return spec
    return spec.with_fields(**deepseek2_fields(  # MLA as MQA over the latent
        lambda key: field_value(reader, f"{arch}.{key}"), num_layers, heads, spec.rope.scaling))
