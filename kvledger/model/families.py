"""Which forward pass runs a model: Hugging Face ``model_type`` -> the family's model class.

One module of :mod:`kvledger.model` per architecture family (:mod:`.llama` for llama / mistral
/ qwen2, :mod:`.qwen3`, :mod:`.phi3`, :mod:`.gemma` for gemma2 / gemma3_text); a new family is
its module plus its class here. A family's class is built as
``cls(spec, weights, dtype, attention=..., formats=...)`` and offers what the engine reads
(as :class:`kvledger.model.llama.LlamaModel` does): ``forward`` and ``compute_logits`` (the
runner), ``rope`` (key turns of retained tokens), ``attention``, ``dtype``,
``weight_formats`` and ``decode_weight_bytes``; ``check_supported(spec)`` refuses a spec that
needs a feature it does not compute.
"""

from __future__ import annotations

from kvledger.errors import UnsupportedModelError
from kvledger.model.gemma import GemmaModel
from kvledger.model.llama import LlamaModel
from kvledger.model.phi3 import Phi3Model
from kvledger.model.qwen3 import Qwen3Model
from kvledger.spec import ModelSpec

FAMILIES: dict[str, type[LlamaModel]] = {
    model_type: cls for cls in (LlamaModel, Qwen3Model, Phi3Model, GemmaModel)
    for model_type in cls.MODEL_TYPES}
"""model_type -> the class that runs it."""
PLAN_ONLY = {"gpt2": "a LayerNorm, learned-position decoder",
             "gpt_neox": "a LayerNorm decoder with parallel attention and MLP",
             "deepseek_v3": "multi-head latent attention and routed experts"}
"""Families ``kvledger plan`` sizes that the engine refuses by name, with what they are."""


def model_class(spec: ModelSpec) -> type[LlamaModel]:
    """The family class that runs ``spec``, after its check of the spec's features.

    Raises:
        UnsupportedModelError: no family runs ``spec.model_type``, or its family does not
            compute a feature the spec needs (the message names them and what is supported).
    """
    if spec.model_type not in FAMILIES:
        what = f" ({PLAN_ONLY[spec.model_type]})" if spec.model_type in PLAN_ONLY else ""
        raise UnsupportedModelError(
            f"model_type {spec.model_type!r}{what} cannot run in the engine yet (supported: "
            f"{', '.join(FAMILIES)}); `kvledger plan` still sizes it")
    cls = FAMILIES[spec.model_type]
    cls.check_supported(spec)
    return cls
