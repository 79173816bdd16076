"""Which forward pass runs a model: the engine family :func:`kvledger.spec.check_runnable`
names -> its model class.

One module of :mod:`kvledger.model` per architecture family (:mod:`.llama` for llama / mistral
/ qwen2, :mod:`.qwen3`, :mod:`.phi3`, :mod:`.gemma` for gemma2 / gemma3_text, :mod:`.moe` for
mixtral / qwen3_moe, :mod:`.gpt_oss`, :mod:`.deepseek` for deepseek_v2); a new family is
its module, its class here and its model types and field values in ``spec/runnable.py``. A
family's class is built as ``cls(spec, weights, dtype, attention=..., formats=...)`` and
offers what the engine reads (as :class:`kvledger.model.llama.LlamaModel` does): ``forward``
and ``compute_logits`` (the runner), ``rope`` (key turns of retained tokens), ``attention``,
``dtype``, ``weight_formats`` and ``decode_weight_bytes``.
"""

from __future__ import annotations

from kvledger.model.deepseek import DeepseekModel
from kvledger.model.gemma import GemmaModel
from kvledger.model.gpt_oss import GptOssModel
from kvledger.model.llama import LlamaModel
from kvledger.model.moe import MoEModel
from kvledger.model.phi3 import Phi3Model
from kvledger.model.qwen3 import Qwen3Model
from kvledger.spec import FAMILY_TYPES, ModelSpec, check_runnable

CLASSES: dict[str, type[LlamaModel]] = {
    cls.FAMILY: cls for cls in (LlamaModel, Qwen3Model, Phi3Model, GemmaModel, MoEModel,
                                GptOssModel, DeepseekModel)}
"""Engine family (``kvledger.spec.FAMILY_TYPES``) -> the class that runs it."""
FAMILIES: dict[str, type[LlamaModel]] = {
    model_type: CLASSES[family] for family, types in FAMILY_TYPES.items() for model_type in types}
"""model_type -> the class that runs it."""


def model_class(spec: ModelSpec) -> type[LlamaModel]:
    """The family class that runs ``spec``, once :func:`kvledger.spec.check_runnable` passes.

    Raises:
        UnsupportedModelError: as :func:`kvledger.spec.check_runnable`.
    """
    return CLASSES[check_runnable(spec)]
