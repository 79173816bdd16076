"""The family descriptor and its table (``kvledger/spec/family.py``): the generic readers take
everything family-specific from the descriptor they are given, and no key is claimed twice."""

from __future__ import annotations

import json

import pytest

from kvledger.spec import (
    FULL,
    SLIDING,
    ConfigWarning,
    Family,
    FamilyTable,
    every_nth_full,
    spec_from_hf_config,
)

TOY = Family(
    name="toy",
    model_types=("toy",),
    aliases={"toy_wrapper": "toy"},
    config_prepare=lambda cfg: {{"n_layer": "num_hidden_layers"}.get(k, k): v
                                for k, v in cfg.items()},
    config_defaults={"toy": {"sliding_window": 8, "tie_word_embeddings": True}},
    config_fields=lambda c, n: {"qk_norm": True},
    layer_types=lambda c, n: every_nth_full(2, n),
)
CONFIG = {"model_type": "toy_wrapper", "n_layer": 4, "hidden_size": 32, "intermediate_size": 64,
          "num_attention_heads": 4, "vocab_size": 128, "max_position_embeddings": 128}


def test_the_generic_reader_takes_the_familys_reading(tmp_path):
    path = tmp_path / "config.json"
    path.write_text(json.dumps(CONFIG))
    spec = spec_from_hf_config(path, FamilyTable([TOY]))
    assert spec.model_type == "toy" and spec.num_layers == 4  # alias and spelling
    assert spec.tie_word_embeddings and spec.layers.sliding_window == 8  # defaults
    assert spec.attention.qk_norm and spec.layers.types == (SLIDING, FULL) * 2  # fields and placement


def test_a_type_no_family_reads_is_read_generically_with_a_warning(tmp_path):
    path = tmp_path / "config.json"
    path.write_text(json.dumps(CONFIG | {"num_hidden_layers": 4}))
    with pytest.warns(ConfigWarning, match="toy_wrapper"):
        spec = spec_from_hf_config(path, FamilyTable([]))
    assert spec.layers.types == (FULL,) * 4 and spec.tie_word_embeddings


def test_a_key_is_claimed_by_one_family():
    with pytest.raises(ValueError, match="'toy' is claimed by toy and other"):
        FamilyTable([TOY, Family(name="other", model_types=("toy",))])
    with pytest.raises(ValueError, match="'arch' is claimed"):
        FamilyTable([Family(name="a", model_types=("a",), gguf_archs={"arch": "a"}),
                     Family(name="b", model_types=("b",), gguf_archs={"arch": "b"})])
    table = FamilyTable([TOY, Family(name="plan", model_types=("plan",), what="a plan")])
    assert table.of_type("toy_wrapper") is TOY and table.engine_model_types == ()
