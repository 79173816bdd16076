"""The model spec: what a model is, read from the format it comes in.

``ModelSpec`` (:mod:`.model_spec`) is the data type: every architectural number the ledger and
the engine need, counts rather than bytes, grouped by concept (:mod:`.groups`), built
by :meth:`ModelSpec.from_fields` from the flat Hugging Face names. The generic readers build it, one per source format,
each through the family that reads the model (a :class:`Family` descriptor, :mod:`.family`):
:mod:`.hf_config` (a Hugging Face ``config.json``, read with :class:`Config`,
:mod:`.config`) and :mod:`.gguf_reader` (a GGUF file's header, seen by a family as a
:class:`GGUFHeader`); :func:`read_spec` (:mod:`.load`) picks the reader for a model argument;
:func:`check_runnable` (:mod:`.runnable`) refuses what the engine would not compute exactly.
Every reader takes the :class:`FamilyTable` as a parameter: the families and their registry
live above this package (``kvledger.model.families``, whose ``load_spec`` callers use). No
torch here: the planner runs without an ML stack.

Code outside this package imports the names below from ``kvledger.spec``, never a module of
the package (``tests/test_imports.py`` checks it).
"""

from kvledger.spec.config import Config
from kvledger.spec.family import Family, FamilyTable
from kvledger.spec.gguf_reader import (
    GGUFHeader,
    check_gguf_magic,
    open_gguf,
    spec_from_gguf,
    spec_from_gguf_reader,
)
from kvledger.spec.groups import (
    CONV,
    FULL,
    LINEAR,
    MAMBA,
    MLA,
    SLIDING,
    STATE_KINDS,
    Attention,
    Experts,
    GgufFacts,
    Latent,
    LayerKinds,
    LinearAttention,
    Mamba,
    Mlp,
    MuP,
    Norm,
    Rope,
    State,
)
from kvledger.spec.hf_config import ConfigWarning, spec_from_hf_config
from kvledger.spec.load import read_spec
from kvledger.spec.model_spec import ModelSpec
from kvledger.spec.placement import (
    every_nth_full,
    sliding_from,
    uniform_window,
    use_sliding_window,
)
from kvledger.spec.runnable import (
    any_value,
    check_runnable,
    full_and_sliding,
    is_,
    is_set,
    leading,
    rope_types,
)

__all__ = [
    "CONV",
    "FULL",
    "LINEAR",
    "MAMBA",
    "MLA",
    "SLIDING",
    "STATE_KINDS",
    "Attention",
    "Config",
    "ConfigWarning",
    "Experts",
    "Family",
    "FamilyTable",
    "GGUFHeader",
    "GgufFacts",
    "Latent",
    "LayerKinds",
    "LinearAttention",
    "Mamba",
    "Mlp",
    "ModelSpec",
    "MuP",
    "Norm",
    "Rope",
    "State",
    "any_value",
    "check_gguf_magic",
    "check_runnable",
    "every_nth_full",
    "full_and_sliding",
    "is_",
    "is_set",
    "leading",
    "open_gguf",
    "read_spec",
    "rope_types",
    "sliding_from",
    "spec_from_gguf",
    "spec_from_gguf_reader",
    "spec_from_hf_config",
    "uniform_window",
    "use_sliding_window",
]
