"""GrammarCache: a byte budget, the heaviest tenant evicted first, failures never kept."""

from __future__ import annotations

import concurrent.futures

from kvledger.engine.sample.structured.cache import GrammarCache


def _add(cache: GrammarCache, key: str, tenant: str, nbytes: int) -> None:
    future = cache.get_or_start(key, tenant, concurrent.futures.Future)
    cache.set_size(key, future, nbytes)
    future.set_result(key)


def test_the_bytes_stay_within_the_budget_least_recently_used_first():
    cache = GrammarCache(budget_bytes=100)
    for key in "abcd":
        _add(cache, key, "t", 30)
    assert cache.nbytes == 90 and "a" not in cache and "b" in cache
    cache.get_or_start("b", "t", concurrent.futures.Future)  # b is used again
    _add(cache, "e", "t", 30)
    assert "b" in cache and "c" not in cache


def test_one_tenant_flooding_the_cache_evicts_only_its_own_entries():
    cache = GrammarCache(budget_bytes=100)
    _add(cache, "mine", "alice", 20)
    for i in range(20):
        _add(cache, f"flood-{i}", "mallory", 30)
    assert "mine" in cache and cache.nbytes <= 100


def test_a_failed_compile_is_not_kept():
    cache = GrammarCache(budget_bytes=100)
    future = cache.get_or_start("bad", None, concurrent.futures.Future)
    future.set_exception(ValueError("no"))
    assert "bad" not in cache
    assert cache.get_or_start("bad", None, concurrent.futures.Future) is not future
