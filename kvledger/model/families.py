"""Which forward pass runs a model: Hugging Face ``model_type`` -> the family's model class.

One module of :mod:`kvledger.model` per architecture family (:mod:`.llama`); a new family is
its module plus its ``model_type`` values here. A family's class is built as
``cls(spec, weights, dtype, attention=..., formats=...)`` and offers what the engine reads
(as :class:`kvledger.model.llama.LlamaModel` does): ``forward`` and ``compute_logits`` (the
runner), ``rope`` (key turns of retained tokens), ``attention``, ``dtype``,
``weight_formats`` and ``decode_weight_bytes``.
"""

from __future__ import annotations

from kvledger.errors import UnsupportedModelError
from kvledger.model.llama import LlamaModel
from kvledger.spec import ENGINE_MODEL_TYPES as LLAMA_TYPES
from kvledger.spec import ModelSpec

FAMILIES: dict[str, type[LlamaModel]] = dict.fromkeys(LLAMA_TYPES, LlamaModel)
"""model_type -> the class that runs it."""


def model_class(spec: ModelSpec) -> type[LlamaModel]:
    """The family class that runs ``spec``.

    Raises:
        UnsupportedModelError: no family runs ``spec.model_type``.
    """
    if spec.model_type not in FAMILIES:
        raise UnsupportedModelError(
            f"model_type {spec.model_type!r} cannot run in the engine yet (supported: "
            f"{', '.join(FAMILIES)}); `kvledger plan` still sizes it")
    return FAMILIES[spec.model_type]
