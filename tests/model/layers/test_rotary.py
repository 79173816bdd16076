"""YaRN (``kvledger.model.layers.rotary``) against transformers' ``_compute_yarn_parameters``: the
inverse frequencies and the attention factor, for gpt-oss-20b's catalogue config and variants
of each option (truncate, beta_fast / beta_slow, a factor from the context, mscale pairs, an
explicit attention_factor)."""

from __future__ import annotations

import pytest
import torch

from kvledger.data import config_path
from kvledger.model.families import load_spec
from kvledger.model.layers.rotary import RotaryEmbedding, attention_factor, inverse_frequencies

VARIANTS = [
    {},
    {"truncate": True},
    {"beta_fast": 16.0, "beta_slow": 2.0},
    {"factor": None},
    {"mscale": 1.0, "mscale_all_dim": 0.707},
    {"attention_factor": 1.25},
]


def _theirs(spec, scaling: dict) -> tuple[torch.Tensor, float]:
    from transformers import GptOssConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    config = GptOssConfig(head_dim=spec.head_dim, hidden_size=spec.hidden_size,
                          num_attention_heads=spec.num_attention_heads,
                          max_position_embeddings=spec.max_position_embeddings,
                          rope_parameters={**scaling, "rope_theta": spec.rope.theta})
    return ROPE_INIT_FUNCTIONS["yarn"](config)


@pytest.mark.parametrize("variant", VARIANTS, ids=lambda v: ",".join(v) or "gpt-oss-20b")
def test_yarn_matches_transformers(variant):
    spec = load_spec(config_path("openai__gpt-oss-20b"))
    scaling = {**spec.rope.scaling, **variant}
    assert scaling["rope_type"] == "yarn"
    inv_freq, factor = _theirs(spec, scaling)
    ours = inverse_frequencies(spec.head_dim, spec.rope.theta, scaling,
                               spec.max_position_embeddings)
    torch.testing.assert_close(ours, inv_freq, rtol=1e-6, atol=0)
    assert attention_factor(scaling, spec.max_position_embeddings) == pytest.approx(factor,
                                                                                   rel=1e-12)


def test_the_tables_carry_the_attention_factor():
    """cos and sin are scaled by YaRN's 0.1 ln(32) + 1 for gpt-oss-20b (factor 32)."""
    spec = load_spec(config_path("openai__gpt-oss-20b"))
    rope = RotaryEmbedding(spec.head_dim, 8, spec.rope.theta, spec.rope.scaling, torch.float32)
    assert float(rope.cos[0, 0]) == pytest.approx(0.1 * torch.log(torch.tensor(32.0)) + 1)
