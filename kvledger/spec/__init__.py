"""The model spec: what a model is, read from the format it comes in.

``ModelSpec`` (:mod:`.model_spec`) is the data type: every architectural number the ledger and
the engine need, counts rather than bytes, grouped by concept (:mod:`.groups`). One reader
per source format builds it (:meth:`ModelSpec.from_fields`): :mod:`.hf_config` (a Hugging Face
``config.json``) and :mod:`.gguf_reader` (a GGUF file's header). :func:`load_spec` (:mod:`.load`) picks the reader for a model argument;
:func:`check_runnable` (:mod:`.runnable`) refuses what the engine would not compute exactly and
names the engine family that runs the rest (``FAMILY_TYPES``). No torch here: the planner runs
without an ML stack.

Code outside this package imports the names below from ``kvledger.spec``, never a module of
the package (``tests/test_imports.py`` checks it).
"""

from kvledger.spec.gguf_reader import (
    GGUF_MODEL_TYPES,
    check_gguf_magic,
    open_gguf,
    spec_from_gguf,
    spec_from_gguf_reader,
)
from kvledger.spec.groups import (
    FULL,
    LINEAR,
    MLA,
    SLIDING,
    Attention,
    Experts,
    GgufFacts,
    Latent,
    LayerKinds,
    LinearAttention,
    Mlp,
    Norm,
    Rope,
)
from kvledger.spec.hf_config import ConfigWarning, spec_from_hf_config
from kvledger.spec.load import load_spec
from kvledger.spec.model_spec import ModelSpec
from kvledger.spec.runnable import ENGINE_MODEL_TYPES, FAMILY_TYPES, check_runnable

__all__ = [
    "ENGINE_MODEL_TYPES",
    "FAMILY_TYPES",
    "FULL",
    "GGUF_MODEL_TYPES",
    "LINEAR",
    "MLA",
    "SLIDING",
    "Attention",
    "ConfigWarning",
    "Experts",
    "GgufFacts",
    "Latent",
    "LayerKinds",
    "LinearAttention",
    "Mlp",
    "ModelSpec",
    "Norm",
    "Rope",
    "check_gguf_magic",
    "check_runnable",
    "load_spec",
    "open_gguf",
    "spec_from_gguf",
    "spec_from_gguf_reader",
    "spec_from_hf_config",
]
