"""Gemma 2 and Gemma 3 (text): the Llama decoder with Gemma's changes (Gemma Team, "Gemma 2",
arXiv:2408.00118 §2; "Gemma 3 Technical Report", arXiv:2503.19786 §2; transformers'
``Gemma2Model`` / ``Gemma3TextModel``):

- RMSNorm as ``x / rms(x) * (1 + w)``: every norm weight is held as ``1 + w``;
- norms before and after attention and before and after the MLP (sandwich);
- GeGLU with tanh-approximated GELU (``gelu_pytorch_tanh``);
- the embedding scaled by sqrt(hidden), that factor rounded to the model's dtype first;
- scores scaled by ``query_pre_attn_scalar ** -0.5``;
- Gemma 2: attention scores and final logits soft-capped, ``c tanh(x / c)``;
- interleaved sliding and global layers (``layer_types``; older configs: Gemma 2's even layers,
  Gemma 3's all but each ``sliding_window_pattern``-th);
- Gemma 3: per-head q and k norms, the sliding layers' own RoPE base (``rope_local_base_freq``)
  and the global layers' RoPE scaling (linear, factor 8 on 4B and up).

A multimodal Gemma 3 config (4B and up, ``model_type: gemma3``) nests the decoder under
``text_config`` and is read as ``gemma3_text``; its folder loads the text model only.

GGUF (what the converter does not store follows llama.cpp's loader, ``src/models/gemma*.cpp``):
``query_pre_attn_scalar`` is hidden / heads for the 27B models (46 layers in Gemma 2, 62 in
Gemma 3), else head_dim; Gemma 2 slides on even layers, Gemma 3 on all but every sixth; Gemma 3's
local RoPE base is ``rope.freq_base_swa``, else 10,000. The converter writes
``post_attention_layernorm`` as ``post_attention_norm``, ``pre_feedforward_layernorm`` as
``ffn_norm``, ``post_feedforward_layernorm`` as ``post_ffw_norm``, and every norm weight as
``1 + w``.
"""

from __future__ import annotations

from functools import cache

from kvledger.spec import (
    Config,
    Family,
    GGUFHeader,
    ModelSpec,
    any_value,
    every_nth_full,
    full_and_sliding,
    is_,
)

_GEMMA2 = {"tie_word_embeddings": True, "hidden_activation": "gelu_pytorch_tanh",
           "query_pre_attn_scalar": 256, "attn_logit_softcapping": 50.0,
           "final_logit_softcapping": 30.0, "rms_norm_eps": 1e-6, "bos_token_id": 2,
           "eos_token_id": 1}
_GEMMA3_TEXT = {
    "tie_word_embeddings": True, "rms_norm_eps": 1e-6, "bos_token_id": 2, "eos_token_id": 1,
    "hidden_activation": "gelu_pytorch_tanh", "query_pre_attn_scalar": 256,
    "rope_local_base_freq": 10_000.0, "num_attention_heads": 8, "num_key_value_heads": 4,
    "head_dim": 256, "vocab_size": 262208, "max_position_embeddings": 131072,
    "sliding_window": 4096, "sliding_window_pattern": 6, "rope_theta": 1_000_000.0}
_27B_LAYERS = {"gemma2": 46, "gemma3": 62}
_TEXT_PREFIXES = (("language_model.model.", "model."), ("model.language_model.", "model."),
                  ("language_model.lm_head.", "lm_head."))
_NOT_TEXT = ("vision_tower.", "multi_modal_projector.", "model.vision_tower.",
             "model.multi_modal_projector.")


def _config_fields(c: Config, n: int) -> dict:
    out = {"norms_per_layer": 4, "query_pre_attn_scalar": float(c.req("query_pre_attn_scalar")),
           "attn_logit_softcapping": c.float_or_none("attn_logit_softcapping"),
           "final_logit_softcapping": c.float_or_none("final_logit_softcapping")}
    return out | ({"qk_norm": True} if c.model_type == "gemma3_text" else {})


def _layer_types(c: Config, n: int) -> tuple[str, ...]:
    if c.model_type == "gemma2":
        return every_nth_full(2, n)
    return every_nth_full(int(c.req("sliding_window_pattern")), n)


def _gguf_fields(header: GGUFHeader, fields: dict) -> dict:
    big = fields["num_layers"] == _27B_LAYERS[header.arch]
    hidden, heads = fields["hidden_size"], fields["num_attention_heads"]
    out = {"hidden_act": "gelu_pytorch_tanh", "norms_per_layer": 4,
           "query_pre_attn_scalar": float(hidden // heads if big else fields["head_dim"]),
           "attn_logit_softcapping": header.float("attn_logit_softcapping"),
           "final_logit_softcapping": header.float("final_logit_softcapping")}
    if header.arch == "gemma3":
        out["rope_local_base_freq"] = header.float("rope.freq_base_swa") or 10_000.0
    return out


def _weight_names(state: dict, spec: ModelSpec) -> None:
    """A multimodal folder's text model, ``language_model.model.*`` (transformers 4) or
    ``model.language_model.*`` (transformers 5) -> ``model.*``, ``language_model.lm_head`` ->
    ``lm_head``; the vision tower and the projector dropped."""
    for name in list(state):
        if name.startswith(_NOT_TEXT):
            del state[name]
            continue
        for old, new in _TEXT_PREFIXES:
            if name.startswith(old):
                state[new + name[len(old):]] = state.pop(name)
                break


@cache
def _model() -> type:
    from kvledger.model.layers.decoder import Decoder

    class GemmaDecoder(Decoder):
        """The decoder with Gemma's ``(1 + w)`` norms and sqrt(hidden)-scaled embedding."""

        NORM_OFFSET = FAMILY.norm_offset
        SCALED_EMBEDDING = True

    return GemmaDecoder


_NORMS = {"post_attention_norm": "post_attention_layernorm",
          "ffn_norm": "pre_feedforward_layernorm", "post_ffw_norm": "post_feedforward_layernorm"}
FAMILY = Family(
    name="gemma",
    model_types=("gemma2", "gemma3_text"),
    runs={"layer_types": full_and_sliding, "sliding_window": any_value, "qk_norm": any_value,
          "norms_per_layer": is_(4), "hidden_act": is_("gelu_pytorch_tanh"),
          "rope_local_base_freq": any_value, "query_pre_attn_scalar": any_value,
          "attn_logit_softcapping": any_value, "final_logit_softcapping": any_value},
    aliases={"gemma3": "gemma3_text"},
    config_defaults={"gemma2": _GEMMA2, "gemma3_text": _GEMMA3_TEXT},
    config_fields=_config_fields,
    layer_types=_layer_types,
    gguf_archs={"gemma2": "gemma2", "gemma3": "gemma3_text"},
    gguf_fields=_gguf_fields,
    gguf_sliding_period={"gemma2": 2, "gemma3": 6},  # llama.cpp's load_swa_pattern defaults
    gguf_tensors=_NORMS,
    gguf_norm_plus_one=True,
    weight_names=_weight_names,
    norm_offset=1.0,
    model=_model,
)
