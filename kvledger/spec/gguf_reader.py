"""ModelSpec from a GGUF file's metadata, through the family that reads its architecture (a
:class:`~kvledger.spec.family.Family` of the table given).

GGUF (the llama.cpp file format, https://github.com/ggml-org/ggml/blob/master/docs/gguf.md)
stores the architecture as key/value metadata named ``{arch}.<key>`` plus a list of tensor
infos (name, shape, type). This module reads only the header through the ``gguf`` package's
``GGUFReader`` (the file is memory-mapped; no tensor data is dequantized) and never imports
torch, so the planner can use it without an ML stack.

Invariants of the generic reader (a family adds what its converter leaves to llama.cpp's
loader, ``Family.gguf_fields``):
  * ``head_dim`` is ``{arch}.attention.key_length`` when present, else hidden / heads; a
    per-layer ``attention.head_count_kv`` (a hybrid's, 0 on its state layers) reads as its
    largest count, the family placing the layers.
  * ``tie_word_embeddings`` is true exactly when the file has no ``output.weight`` tensor
    (llama.cpp converters drop the head when it shares the embedding matrix).
  * ``gguf_tensor_elements`` / ``gguf_tensor_bytes`` sum every tensor in the file, so the
    ledger's weight bytes for a GGUF are what the file really holds.
  * Sliding layers: llama.cpp's ``{arch}.attention.sliding_window_pattern`` array, else the
    family's default period for the architecture (``Family.gguf_sliding_period``), else every
    layer slides when the file has a window. Phi-3's LongRoPE factors are the
    ``rope_factors_long`` / ``rope_factors_short`` tensors (read from the file, a few hundred
    floats).
  * Experts (``{arch}.expert_count`` > 0): ``expert_used_count`` per token, each of
    ``expert_feed_forward_length`` (else ``feed_forward_length``); a layer routes when it has
    a router tensor ``blk.N.ffn_gate_inp``; no dense MLP (``intermediate_size`` 0) when the
    file has no ``feed_forward_length`` (qwen35moe); the top-k weights are renormalised unless
    ``{arch}.expert_weights_norm`` is false (llama.cpp's llama and qwen3moe graphs normalise).
  * ``eos_token_ids`` starts with ``tokenizer.ggml.eos_token_id`` and adds
    ``tokenizer.ggml.eot_token_id`` and the chat-end tokens (``<|im_end|>``, ``<|eot_id|>``,
    ``<|end_of_text|>``) that the vocabulary contains.

Errors: a file without the GGUF magic -> ConfigError("not a GGUF file: PATH"); a missing
required key -> ConfigError naming the key and the file; an architecture no family reads ->
UnsupportedModelError.
"""

from __future__ import annotations

import os
from pathlib import Path

from kvledger.errors import ConfigError, UnsupportedModelError
from kvledger.paths import model_id
from kvledger.spec.family import FamilyTable
from kvledger.spec.groups import FULL, SLIDING
from kvledger.spec.model_spec import ModelSpec

CHAT_END_TOKENS = ("<|im_end|>", "<|eot_id|>", "<|end_of_text|>", "<end_of_turn>", "<|end|>")
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


def float32(value) -> float:
    """Shortest decimal of a FLOAT32 metadata value (9.99999975e-06 -> 1e-05, as in config.json)."""
    import numpy as np

    return float(str(np.float32(value)))


class GGUFHeader:
    """An open GGUF file's metadata as a family reads it: ``{arch}.``-prefixed values and the
    names of its tensors."""

    def __init__(self, reader, arch: str, path: Path) -> None:
        self.reader, self.arch, self.path = reader, arch, path
        self.tensor_names = {t.name for t in reader.tensors}

    def value(self, key: str):
        """Value of ``{arch}.{key}``, None when absent."""
        return field_value(self.reader, f"{self.arch}.{key}")

    def float(self, key: str) -> float | None:
        """``{arch}.{key}`` as a FLOAT32's shortest decimal, None when absent."""
        found = self.value(key)
        return None if found is None else float32(found)


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
            scaling[hf] = float32(value)
    return scaling


def _tensor_floats(reader, name: str) -> list[float] | None:
    """The values of a small F32 tensor ``name`` as floats (None when absent)."""
    tensor = next((t for t in reader.tensors if t.name == name), None)
    return None if tensor is None else [float32(x) for x in tensor.data.tolist()]


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
        scaling["attention_factor"] = float32(factor)
    return scaling


def _layer_kinds(reader, arch: str, num_layers: int, window, period: int | None
                 ) -> tuple[str, ...]:
    """Per-layer kinds: llama.cpp's ``sliding_window_pattern`` array, else the family's default
    ``period`` for the architecture (every layer slides when it has none)."""
    if not window:
        return (FULL,) * num_layers
    listed = field_value(reader, f"{arch}.attention.sliding_window_pattern")
    if isinstance(listed, list) and len(listed) == num_layers:
        return tuple(SLIDING if slides else FULL for slides in listed)
    if period is None:
        return (SLIDING,) * num_layers
    return tuple(SLIDING if i % period < period - 1 else FULL for i in range(num_layers))


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


def spec_from_gguf(path: str | os.PathLike, families: FamilyTable) -> ModelSpec:
    """Read the architecture numbers of a GGUF file of an architecture a family of
    ``families`` reads.

    Args:
        path: a ``.gguf`` file.
    Returns:
        ModelSpec with ``source`` = the path and ``gguf_tensor_elements`` (elements) and
        ``gguf_tensor_bytes`` (bytes) summed over every tensor of the file.
    Raises:
        ConfigError: not a GGUF file, or a required key is missing.
        UnsupportedModelError: an architecture no family reads.
    """
    path = Path(path)
    return spec_from_gguf_reader(open_gguf(path), path, families)


def spec_from_gguf_reader(reader, path: Path, families: FamilyTable) -> ModelSpec:
    """:func:`spec_from_gguf` for an already open ``GGUFReader`` of the file at ``path``."""
    arch = _require(reader, "general.architecture", path)
    family = families.of_arch(arch)
    if family is None:
        raise UnsupportedModelError(
            f"GGUF architecture {arch!r} in {path} is not supported (GGUF files are read for "
            f"{', '.join(families.gguf_model_types)}; the engine runs "
            f"{', '.join(families.engine_model_types)})"
        )
    header = GGUFHeader(reader, arch, path)

    def req(key: str):
        return _require(reader, f"{arch}.{key}", path)

    hidden = int(req("embedding_length"))
    heads = int(req("attention.head_count"))
    kv_heads = header.value("attention.head_count_kv")  # per layer in hybrid files (0: none)
    kv_heads = int((max(kv_heads) if isinstance(kv_heads, list) else kv_heads) or heads)
    head_dim = header.value("attention.key_length") or hidden // heads
    tokens = field_value(reader, "tokenizer.ggml.tokens")
    vocab = header.value("vocab_size") or (len(tokens) if tokens else None)
    if vocab is None:
        raise ConfigError(f"GGUF file {path} lacks {arch}.vocab_size and tokenizer.ggml.tokens")
    tensor_names = header.tensor_names
    bos = field_value(reader, "tokenizer.ggml.bos_token_id")
    num_layers = int(req("block_count"))
    window = header.value("attention.sliding_window")
    rotary = header.value("rope.dimension_count")
    moe = _moe_fields(reader, arch, num_layers, tensor_names)
    dense_ff = header.value("feed_forward_length")
    fields = dict(
        **moe,
        name=model_id(path),
        model_type=family.gguf_archs[arch],
        num_layers=num_layers,
        hidden_size=hidden,
        num_attention_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=int(head_dim),
        intermediate_size=0 if moe and dense_ff is None else int(req("feed_forward_length")),
        vocab_size=int(vocab),
        max_position_embeddings=int(req("context_length")),
        tie_word_embeddings="output.weight" not in tensor_names,
        rms_norm_eps=float32(req("attention.layer_norm_rms_epsilon")),
        rope_theta=float32(header.value("rope.freq_base") or 10000.0),
        rope_scaling=_longrope(reader, arch, path) or _rope_scaling(reader, arch),
        partial_rotary_factor=int(rotary) / int(head_dim) if rotary else 1.0,
        qkv_bias="blk.0.attn_q.bias" in tensor_names,
        o_bias="blk.0.attn_output.bias" in tensor_names,
        mlp_bias=any(f"blk.0.ffn_{p}.bias" in tensor_names for p in ("gate", "up", "down")),
        qk_norm="blk.0.attn_q_norm.weight" in tensor_names,
        layer_types=_layer_kinds(reader, arch, num_layers, window,
                                 family.gguf_sliding_period.get(arch)),
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
    return ModelSpec.from_fields(**fields | family.gguf_fields(header, fields))
