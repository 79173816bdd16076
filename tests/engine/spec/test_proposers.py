"""The proposers by hand: prompt lookup takes the longest n-gram's latest occurrence; the
suffix index walks recent outputs and stays bounded; the config refuses by name."""

from __future__ import annotations

import numpy as np
import pytest

from kvledger.engine.spec.config import SpeculativeConfig
from kvledger.engine.spec.ngram import lookup
from kvledger.engine.spec.proposer import Proposer
from kvledger.engine.spec.suffix import SuffixIndex
from kvledger.errors import InvalidParameterError


def _lookup(tokens, k=3, lo=1, hi=3):
    return lookup(np.array(tokens, dtype=np.int64), k, lo, hi)


def test_ngram_longest_match_latest_occurrence():
    # "1 2 3" occurs at 0 (-> 4 5 6); "2 3" also at 7 (-> 9); the longest (3) wins
    assert _lookup([1, 2, 3, 4, 5, 6, 0, 2, 3, 9, 1, 2, 3]) == ([4, 5, 6], 3)
    # two occurrences of the same n-gram: the latest one's continuation
    assert _lookup([7, 8, 1, 7, 8, 2, 7, 8], hi=2) == ([2, 7, 8], 2)
    # the proposal stops at the sequence's end
    assert _lookup([5, 6, 5, 6], k=5, hi=2) == ([5, 6], 2)
    assert _lookup([1, 2, 3, 4], lo=1) == ([], 0)


def test_suffix_index_walks_recent_outputs_and_forgets_the_oldest():
    index = SuffixIndex(n_min=2, n_max=3, max_requests=2)
    index.add([1, 2], [10, 11, 12, 13])
    assert index.propose([9, 10, 11], 3) == ([12, 13], 2)
    index.add([3], [20, 21, 22])
    index.add([4], [30, 31, 32])  # the first request leaves
    assert index.propose([9, 10, 11], 3) == ([], 0)
    assert index.propose([20, 21], 2) == ([22], 2)
    # what is left is exactly the two kept requests' contexts
    kept = SuffixIndex(2, 3, 2)
    kept.add([3], [20, 21, 22])
    kept.add([4], [30, 31, 32])
    assert index._next == kept._next


def test_suffix_prefers_the_most_frequent_continuation():
    index = SuffixIndex(2, 2, 8)
    for out in ([5, 6, 7], [5, 6, 7], [5, 6, 8]):
        index.add([], out)
    assert index.propose([5, 6], 1) == ([7], 2)


def test_auto_takes_the_longer_match():
    proposer = Proposer(SpeculativeConfig(method="auto", prompt_lookup_min=2,
                                          prompt_lookup_max=3))
    proposer.finished([0], [40, 41, 42, 43])
    assert proposer.propose([1, 40, 41, 42], 2) == ([43], "suffix")
    assert proposer.propose([1, 2, 9, 1, 2], 2) == ([9, 1], "ngram")


@pytest.mark.parametrize("value, named", [
    ({"method": "eagle"}, "'eagle' is not supported"), ({"k": 1}, "unknown key 'k'"),
    ({"method": "ngram", "gate": 1}, "gate must be true or false"),
    ({"prompt_lookup_min": 4, "prompt_lookup_max": 2}, "prompt_lookup_min (4) is over"),
    ("[1]", "must be a JSON object"), ({"method": "nope"}, "method must be one of"),
])
def test_config_refuses_by_name(value, named):
    with pytest.raises(InvalidParameterError, match="speculative_config") as err:
        SpeculativeConfig.parse(value)
    assert named in str(err.value)


@pytest.mark.parametrize("options, named", [
    ({"tensor_parallel_size": 2}, "tensor parallelism"), ({"use_kv_cache": False}, "--no-kv-cache")])
def test_what_speculation_does_not_run_with_is_refused_before_loading(options, named):
    from kvledger.engine.config import EngineConfig

    with pytest.raises(InvalidParameterError, match="speculative_config") as err:
        EngineConfig(speculative_config={"method": "ngram"}, **options)
    assert named in str(err.value)
    EngineConfig(speculative_config={"method": "off"}, **options)  # off runs with anything


def test_config_defaults_follow_vllm():
    assert SpeculativeConfig.parse('{"num_speculative_tokens": 3}').method == "ngram"
    assert SpeculativeConfig.parse(None).enabled is False
