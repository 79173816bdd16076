"""RetentionSpec: sizes, refusals and the KV bounds admission reads (hand-computed figures)."""

from __future__ import annotations

import dataclasses
import re

import pytest

from kvledger.engine.config import EngineConfig
from kvledger.engine.sample.sampling_params import SamplingParams
from kvledger.errors import InvalidParameterError
from kvledger.ledger.retention import RetentionSpec, spec_from_options


@pytest.mark.parametrize("kwargs, message", [
    ({"policy": "lru"}, "kv_policy must be one of"),
    ({"policy": "window", "window": 0}, "kv_window must be an integer > 0"),
    ({"policy": "window", "window": -3}, "kv_window must be an integer > 0"),
    ({"policy": "sinks", "window": 8, "sinks": -1}, "kv_sinks must be an integer >= 0"),
    ({"policy": "window", "window": 1 << 70}, "kv_window must be an integer > 0 and < 2^31"),
    ({"policy": "window"}, "needs kv_window"),
    ({"policy": "h2o"}, "needs kv_budget"),
    ({"policy": "h2o", "budget": 12, "window": 8}, "must be >= kv_sinks + kv_window + 1 = 13"),
    # sinks >= capacity (llama.cpp #3969): refused, never a cache that cannot move
    ({"policy": "h2o", "budget": 4, "sinks": 4, "window": 1}, "no room for heavy hitters"),
    ({"policy": "full", "window": 8}, "takes no kv_window"),
    ({"policy": "snapkv", "budget": 32}, "above its observation window"),
    ({"policy": "window", "window": True}, "kv_window must be an integer"),
    ({"policy": "sinks", "window": 8, "positions": "shifted"}, "kv_positions must be one of"),
    ({"policy": "h2o", "budget": 64, "positions": "cache"},
     "kv_positions 'cache' applies to window and sinks, not 'h2o'"),
    ({"policy": "snapkv", "budget": 64, "positions": "cache"}, "applies to window and sinks"),
    ({"policy": "h2o", "budget": 64, "select": "per-layer"}, "kv_select must be one of"),
    ({"policy": "sinks", "window": 8, "select": "per-head"}, "takes no kv_select"),
    ({"policy": "sinks", "window": 8, "scope": "once"}, "kv_scope must be one of always, prompt"),
    ({"policy": "snapkv", "budget": 64, "scope": "prompt"},
     "kv_scope applies to window, sinks, h2o, not 'snapkv' (it compresses the prompt only)"),
    ({"policy": "full", "scope": "always"}, "not 'full' (it drops no token)"),
    ({"policy": "sinks", "window": 8, "scope": "prompt", "positions": "cache"},
     "kv_positions 'cache' needs kv_scope 'always'"),
    ({"policy": "h2o", "budget": 8, "window": 8, "scope": "prompt"}, "no room for heavy hitters"),
    ({"policy": "h2o", "budget": 64, "h2o_scores": "max"}, "h2o_scores must be one of sum, mean"),
    ({"policy": "snapkv", "budget": 64, "h2o_scores": "mean"}, "'snapkv' takes no h2o_scores"),
])
def test_bad_specs_are_refused(kwargs, message):
    with pytest.raises(InvalidParameterError, match=re.escape(message)):
        RetentionSpec(**kwargs)


def test_defaults_and_capacity():
    assert RetentionSpec("sinks", window=1024).sinks == 4
    assert RetentionSpec("sinks", window=1024).capacity == 1028
    assert RetentionSpec("window", window=64).sinks == 0
    h2o = RetentionSpec("h2o", budget=512)
    assert (h2o.sinks, h2o.window, h2o.capacity) == (4, 256, 512)
    assert RetentionSpec().capacity is None and RetentionSpec("snapkv", budget=64).capacity is None


def test_positions_default_and_plumbing():
    """window/sinks take the default positions unless named; the others keep original ones;
    the engine option and a request's object reach the spec; the description names them."""
    from kvledger.ledger.retention import DEFAULT_POSITIONS

    assert RetentionSpec("sinks", window=8).positions == DEFAULT_POSITIONS
    assert RetentionSpec("h2o", budget=64).positions == "original"
    assert RetentionSpec("h2o", budget=64, positions="original").positions == "original"
    cache = RetentionSpec("sinks", window=8, positions="cache")
    assert cache.describe() == "sinks (4 sinks + 8 recent) at cache positions"
    assert EngineConfig(kv_policy="window", kv_window=8, kv_positions="cache").retention \
        == RetentionSpec("window", window=8, positions="cache")
    assert SamplingParams(kv_policy={"policy": "sinks", "window": 8, "positions": "cache"}
                          ).kv_policy == cache
    with pytest.raises(InvalidParameterError, match="kv_positions needs kv_policy"):
        spec_from_options(None, None, None, None, "cache")
    # a spec's own fields build it again (dataclasses.replace, from_dict(as_dict()))
    window = RetentionSpec("window", window=8)
    assert RetentionSpec.from_dict(window.as_dict()) == window
    assert dataclasses.replace(window, positions="cache").positions == "cache"
    # same bound either way: positions change what a query attends, not what is held
    assert cache.max_kv_blocks(100, 5000, 16) == RetentionSpec(
        "sinks", window=8, positions="original").max_kv_blocks(100, 5000, 16)


def test_bounded_kv_figures():
    spec = RetentionSpec("sinks", window=1024)
    # 100 prompt + 50000 output: 1027 kept between steps + one chunk of 64
    assert spec.max_kv_tokens(100, 50_100) == 1027 + 64
    # blocks: ceil(1091 / 16) = 69, + the sinks block and the window's first block
    assert spec.max_kv_blocks(100, 50_100, 16) == 69 + 2
    # a short request is bounded by full's own figure
    assert spec.max_kv_tokens(10, 20) == 19 and spec.max_kv_blocks(10, 20, 16) == 2
    assert RetentionSpec().max_kv_blocks(10, 50, 16) == 4  # ceil(49 / 16)
    snap = RetentionSpec("snapkv", budget=256)
    # prompt 4000 held until compressed; then 256 + 99 output - 1
    assert snap.max_kv_tokens(4000, 4100) == 4000
    assert snap.max_kv_tokens(300, 2300) == 256 + 2000 - 1


def test_from_dict_refuses_unknown_keys():
    assert RetentionSpec.from_dict({"policy": "window", "window": 5}).window == 5
    with pytest.raises(InvalidParameterError, match="unknown key"):
        RetentionSpec.from_dict({"policy": "window", "window": 5, "size": 3})
    with pytest.raises(InvalidParameterError, match="must be an object"):
        RetentionSpec.from_dict(["window"])


def test_options_config_and_params():
    assert spec_from_options(None, None, None, None) == RetentionSpec()
    with pytest.raises(InvalidParameterError, match="kv_window needs kv_policy"):
        spec_from_options(None, 8, None, None)
    assert EngineConfig(kv_policy="sinks", kv_window=8).retention == RetentionSpec("sinks", 8)
    with pytest.raises(InvalidParameterError):
        EngineConfig(kv_policy="window", kv_window=0)
    params = SamplingParams(kv_policy={"policy": "h2o", "budget": 64})
    assert params.kv_policy == RetentionSpec("h2o", budget=64)
    assert SamplingParams(kv_policy="full").kv_policy == RetentionSpec()
    with pytest.raises(InvalidParameterError, match="unknown key"):
        SamplingParams(kv_policy={"policy": "sinks", "windw": 3})


def test_token_selection_option():
    """h2o/snapkv select per head unless told per sequence; the option reaches the spec from
    the config (--kv-select), a request's object and the command-line helper."""
    assert RetentionSpec("h2o", budget=64).select == "per-head"
    assert RetentionSpec("snapkv", budget=64).select == "per-head"
    assert RetentionSpec("sinks", window=8).select is None
    config = EngineConfig(kv_policy="snapkv", kv_budget=64, kv_select="per-sequence")
    assert config.retention == RetentionSpec("snapkv", budget=64, select="per-sequence")
    params = SamplingParams(kv_policy={"policy": "h2o", "budget": 64, "select": "per-sequence"})
    assert params.kv_policy.select == "per-sequence"
    with pytest.raises(InvalidParameterError, match="kv_select needs kv_policy"):
        spec_from_options(None, None, None, None, select="per-head")
    with pytest.raises(InvalidParameterError, match="kv_select must be one of"):
        EngineConfig(kv_policy="h2o", kv_budget=64, kv_select="both")


def test_prompt_scope_sizes_bounds_and_plumbing():
    """Scope ``prompt``: window/sinks/h2o default to ``always``; in ``prompt`` the KV is not
    bounded during decode (no capacity, like snapkv), the prompt keeps sinks + window
    (window/sinks) or budget (h2o) and the output adds to it; prompt blocks are shareable
    (prefilled in full) but h2o takes no prefix-cache hit (it scores every prompt query).
    Figures by hand."""
    assert RetentionSpec("sinks", window=8).scope == "always"
    assert RetentionSpec("h2o", budget=64).scope == "always"
    assert RetentionSpec("snapkv", budget=64).scope is None and RetentionSpec().scope is None
    sinks = RetentionSpec("sinks", window=252, scope="prompt")
    assert sinks.positions == "original"  # kvpress's positions; nothing moves after the prompt
    assert sinks.capacity is None and sinks.compresses_prompt and sinks.prompt_keep == 256
    # 1536 prompt + 512 output: the prompt held until compressed, then 256 + 511 - 1
    assert sinks.max_kv_tokens(1536, 2048) == 1536
    assert sinks.max_kv_tokens(600, 2600) == 256 + 2000 - 1
    assert sinks.max_kv_blocks(600, 2600, 16) == -(-2255 // 16) + 2
    assert sinks.max_kv_tokens(100, 150) == 149  # a prompt within the budget loses nothing
    always = RetentionSpec("sinks", window=252)
    assert always.max_kv_tokens(600, 2600) == 255 + 64 < sinks.max_kv_tokens(600, 2600)
    h2o = RetentionSpec("h2o", budget=256, scope="prompt")
    assert (h2o.sinks, h2o.window, h2o.prompt_keep, h2o.capacity) == (4, 128, 256, None)
    assert h2o.max_kv_tokens(600, 2600) == 256 + 2000 - 1
    assert (sinks.first_affected, h2o.first_affected) == (256, 256)
    assert sinks.shareable_tokens(600) == h2o.shareable_tokens(600) == 600
    assert sinks.cache_hit_tokens(600) == 600 and h2o.cache_hit_tokens(600) == 0
    assert always.cache_hit_tokens(600) == always.shareable_tokens(600) == 256
    assert sinks.describe() == ("sinks (4 sinks + 252 recent, prompt only, then every token) "
                                "at original positions")
    assert RetentionSpec.from_dict(h2o.as_dict()) == h2o
    assert EngineConfig(kv_policy="h2o", kv_budget=256, kv_scope="prompt").retention == h2o
    assert SamplingParams(kv_policy={"policy": "sinks", "window": 252, "scope": "prompt"}
                          ).kv_policy == sinks
    assert (h2o.h2o_scores, sinks.h2o_scores) == ("sum", None)
    mean = RetentionSpec("h2o", budget=256, scope="prompt", h2o_scores="mean")
    assert "mean scores" in mean.describe() and mean.max_kv_tokens(600, 2600) == 2255
    with pytest.raises(InvalidParameterError, match="kv_scope needs kv_policy"):
        spec_from_options(None, None, None, None, scope="prompt")
