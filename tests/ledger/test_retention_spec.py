"""RetentionSpec: sizes, refusals and the KV bounds admission reads (hand-computed figures)."""

from __future__ import annotations

import dataclasses
import re

import pytest

from kvledger.engine.config import EngineConfig
from kvledger.engine.sampling_params import SamplingParams
from kvledger.errors import InvalidParameterError
from kvledger.ledger.retention import RetentionSpec, spec_from_options


@pytest.mark.parametrize("kwargs, message", [
    ({"policy": "lru"}, "kv_policy must be one of"),
    ({"policy": "window", "window": 0}, "kv_window must be an integer > 0"),
    ({"policy": "window", "window": -3}, "kv_window must be an integer > 0"),
    ({"policy": "sinks", "window": 8, "sinks": -1}, "kv_sinks must be an integer >= 0"),
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
