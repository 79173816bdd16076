"""OLMo 3 (``kvledger/model/families/olmo3.py``) against transformers on the same weights: a
tiny random ``Olmo3ForCausalLM`` with every feature of the released model switched on (post-norms
only, q / k norms over the whole projection with GQA, so k's norm is narrower than q's, three
sliding layers of W = 16 then a full one, YaRN on the full layers only, untied head). Ours
prefills in chunks into scattered blocks and decodes through the paged KV store, for each
attention backend: fp32 logits within 1e-4 of transformers' recomputed ones at prefill and at
16 decode steps; the engine's greedy tokens equal transformers'; and the comparison fails
with each feature switched off in the spec. The catalogue's OLMo-3-7B config runs in the
family.
"""

from __future__ import annotations

import pytest
import torch
from family_kit import SHAPE, W, save_tiny
from oracle_kit import (
    DECODE_STEPS,
    TOL,
    dense_reference,
    fp32_engine,
    greedy_case,
    run_together,
    scattered_diffs,
    seeded_prompt,
    tiny_models,
)

from kvledger.data import config_path
from kvledger.engine.attention import BACKENDS
from kvledger.engine.kv.store import KVStore
from kvledger.engine.sample.sampling_params import SamplingParams
from kvledger.errors import InvalidParameterError
from kvledger.model.families import load_spec, model_class
from kvledger.model.families.olmo3 import FAMILY
from kvledger.spec import FULL, SLIDING

PROMPT = 3 * W + 5
YARN = {"rope_type": "yarn", "rope_theta": 500_000.0, "factor": 4.0,
        "original_max_position_embeddings": 64, "beta_fast": 32.0, "beta_slow": 1.0,
        "attention_factor": 1.2}


def make_olmo3(name: str, folder, seed: int = 0):
    """The tiny model (module docstring), saved in ``folder``."""
    import transformers as tf

    rope = {FULL: YARN, SLIDING: {"rope_type": "default", "rope_theta": 500_000.0}}
    config = tf.Olmo3Config(**SHAPE, num_hidden_layers=8, max_position_embeddings=256,
                            sliding_window=W, rope_parameters=rope, rms_norm_eps=1e-6,
                            tie_word_embeddings=False)
    return save_tiny(config, folder, seed)


tiny = tiny_models(make_olmo3)


def _diffs(spec, weights, hf, attention="reference", steps=DECODE_STEPS) -> list[float]:
    store = KVStore(spec.num_layers, 32, 16, spec.num_kv_heads, spec.head_dim, torch.float32)
    return scattered_diffs(spec, weights, store, seeded_prompt(PROMPT), dense_reference(hf),
                           attention, steps)[0]


def test_the_tiny_model_has_every_feature(tiny):
    _, _, spec, weights = tiny("olmo3")
    assert spec.layers.types == ((SLIDING,) * 3 + (FULL,)) * 2 and spec.layers.sliding_window == W
    assert spec.attention.qk_norm and spec.attention.qk_norm_full_width and spec.num_kv_heads < spec.num_attention_heads
    assert spec.rope.scaling["rope_type"] == "yarn" and spec.rope.local_base_freq == 500_000.0
    assert "model.layers.0.input_layernorm.weight" not in weights
    assert weights["model.layers.0.self_attn.k_norm.weight"].shape == (2 * spec.head_dim,)


@pytest.mark.parametrize("attention", BACKENDS)
def test_logits_match_transformers(tiny, attention):
    _, hf, spec, weights = tiny("olmo3")
    diffs = _diffs(spec, weights, hf, attention)
    assert max(diffs) <= TOL, diffs


ABLATIONS = {
    "q/k norm": {"qk_norm": False},
    "window": {"layer_types": (FULL,) * 8, "sliding_window": None},
    "the sliding layers' unscaled RoPE": {"rope_local_base_freq": None},
}


@pytest.mark.parametrize("feature", ABLATIONS)
def test_the_oracle_fails_without_each_feature(tiny, feature):
    _, hf, spec, weights = tiny("olmo3")
    spec = spec.with_fields(**ABLATIONS[feature])
    assert _diffs(spec, dict(weights), hf, steps=0)[0] > 100 * TOL


def test_greedy_tokens_through_the_engine_equal_transformers(tmp_path_factory):
    """Prompts of 1, W + 1 and 3W + 5 tokens run together, 16 greedy tokens each."""
    lengths, steps = (1, W + 1, PROMPT), 16
    folder, spec, weights, prompts, expected = greedy_case(make_olmo3, "olmo3",
                                                           tmp_path_factory, lengths, steps)
    params = SamplingParams(max_tokens=steps, temperature=0.0, ignore_eos=True)
    assert run_together(fp32_engine(folder, spec, weights), prompts, params) == expected


def test_the_released_config_runs_in_the_family():
    """allenai/Olmo-3-7B-Think's config (transformers 4 spellings: YaRN in ``rope_scaling``,
    which transformers applies to the full layers only)."""
    spec = load_spec(config_path("allenai__Olmo-3-7B-Think"))
    assert model_class(spec) is FAMILY.model()
    assert spec.layers.types[:4] == (SLIDING,) * 3 + (FULL,) and spec.layers.sliding_window == 4096
    assert spec.rope.scaling["factor"] == 8.0 and spec.rope.local_base_freq == spec.rope.theta
    assert (spec.num_layers, spec.hidden_size, spec.vocab_size) == (32, 4096, 100278)


def test_tensor_parallelism_refuses_the_whole_projection_norm():
    """Each rank holds some heads; a norm over all of them is not sharded yet."""
    from kvledger.engine.parallel.shard import check_divisible

    with pytest.raises(InvalidParameterError, match="whole projection"):
        check_divisible(load_spec(config_path("allenai__Olmo-3-7B-Think")), 2)
