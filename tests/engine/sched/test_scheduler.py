"""Scheduler: policy scenarios (incl. the issue's fault scenarios) and random-operation properties.

Every scenario runs through ``sched_harness.Harness``: a fake model whose greedy token depends
only on the prefix (oracle: ``reference_output``, computed without a scheduler) and a fake KV
memory checked through the block tables at every step. Block counts are worked out by hand in
the comments (block size 4 unless said otherwise).
"""

from __future__ import annotations

import pytest
from hypothesis import event, given, settings, target
from hypothesis import strategies as st
from sched_harness import Harness

from kvledger.engine.request import RequestStatus
from kvledger.engine.sched import scheduler as scheduler_module
from kvledger.errors import KVBudgetError


def ids(out) -> list[tuple[str, int]]:
    return [(c.request.request_id, c.num_new_tokens) for c in out.chunks]


def test_whole_prompt_prefill_then_batched_decode():
    h = Harness(32, 4)
    h.add("a", list(range(1, 6)), 3)
    h.add("b", list(range(10, 19)), 3)
    out = h.step()
    assert ids(out) == [("a", 5), ("b", 9)] and all(c.samples for c in out.chunks)
    out = h.step()
    assert ids(out) == [("a", 1), ("b", 1)] and all(c.samples for c in out.chunks)
    h.run()
    h.assert_idle()


def test_max_tokens_none_uses_the_context_limit():
    h = Harness(32, 4, max_model_len=20)
    req = h.add("a", [1, 2, 3, 4, 5], None)
    assert req.max_tokens_effective == 15
    h.run()
    assert len(req.output_token_ids) == 15
    h.assert_idle()


def test_chunked_prefill_interleaves_with_decodes():
    h = Harness(64, 4, max_num_batched_tokens=8)
    h.add("short", [1, 2, 3], 12)
    h.step()
    h.add("long", list(range(5, 45)), 2)  # 40 tokens: 7-token chunks next to a 1-token decode
    starts = []
    while h.reqs["long"].num_computed_tokens < 40:
        out = h.step()
        assert ids(out)[0] == ("short", 1)  # the running stream keeps flowing
        (chunk,) = [c for c in out.chunks if c.request.request_id == "long"]
        starts.append(chunk.start)
        assert chunk.samples == (chunk.start + chunk.num_new_tokens == 40)
    assert starts == [0, 7, 14, 21, 28, 35]
    h.run()
    h.assert_idle()


@pytest.mark.parametrize("budget", [2048, 32])
def test_64_requests_share_a_prefix_ending_mid_block(budget):
    """10-token shared prefix = 2 full blocks + 2 tokens; accounting must balance at idle."""
    h = Harness(400, 4, max_num_batched_tokens=budget)
    prefix = [7, 3, 9, 1, 4, 4, 8, 2, 6, 5]
    for i in range(64):
        h.add(f"r{i}", prefix + [100 + i, 200 + i, 300 + i], 4)
    h.run()
    h.assert_idle()
    # Oracle: distinct full-block prefixes ever computed (nothing evicted: 64 * 5 < 400).
    distinct = {
        tuple(s.all_token_ids[: k * 4])
        for s in h.reqs.values()
        for k in range(1, (s.num_tokens - 1) // 4 + 1)
    }
    stats = h.sched.stats()
    assert stats["kv_blocks_evictable"] == len(distinct) == 2 + 64 * 2
    # each cached block was allocated once, and nothing wrapped around the 400 blocks
    assert len(distinct) <= stats["kv_blocks_touched"] < 400
    assert stats["prefix_cache_queried_tokens"] == 64 * 13
    # The first request computes the 2 prefix blocks; the 63 others wait for them and hit them.
    assert stats["prefix_cache_hit_tokens"] == 63 * 8


@pytest.mark.parametrize("caching", [True, False])
def test_a_block_being_computed_is_waited_for_not_recomputed(caching):
    h = Harness(32, 4, enable_prefix_caching=caching)
    system = [5, 1, 5, 2, 5, 3, 5, 4, 5, 6, 5, 7]  # 3 full blocks
    a = h.add("a", system + [8, 9, 10], 2)
    b = h.add("b", system + [11, 12, 13], 2)
    c = h.add("c", [40, 41, 42, 43, 44], 2)  # unrelated: admitted at once
    if caching:
        assert ids(h.step()) == [("a", 15), ("c", 5)]
        assert ids(h.step()) == [("a", 1), ("c", 1), ("b", 3)]
        assert (a.num_cached_tokens, b.num_cached_tokens) == (0, 12)
    else:
        assert ids(h.step()) == [("a", 15), ("b", 15), ("c", 5)]
    h.run()
    h.assert_idle()
    assert c.num_cached_tokens == 0


def test_abort_in_the_middle_of_a_chunked_prefill():
    h = Harness(20, 4, max_num_batched_tokens=8)
    h.add("a", list(range(30)), 4)
    h.step()
    h.step()
    req = h.reqs["a"]
    assert req.num_computed_tokens == 16 and len(req.block_table) == 4
    h.abort("a")
    assert req.status is RequestStatus.FINISHED and not h.sched.has_unfinished_requests()
    stats = h.sched.stats()
    assert (stats["kv_blocks_free"], stats["kv_blocks_evictable"]) == (20, 4)  # 16 tokens computed
    assert h.sched.schedule().chunks == []
    again = h.add("b", list(range(30)), 4)
    h.step()
    assert again.num_cached_tokens == 16  # the aborted request's computed blocks are re-hit
    assert h.sched.abort("nope") is None
    h.run()
    h.assert_idle()


def test_request_larger_than_the_pool_fails_at_once_small_one_completes():
    h = Harness(8, 4)  # 8 blocks = 32 tokens, 1000 bytes per block
    with pytest.raises(KVBudgetError) as err:
        h.add("big", list(range(40)), 8)
    # prompt 40 + 8 new: 47 tokens ever cached (the last one never) = ceil(47 / 4) = 12 blocks.
    msg = str(err.value)
    for part in ["47 KV tokens", "12 blocks", "12000 bytes", "holds 8 blocks", "8000 bytes"]:
        assert part in msg
    with pytest.raises(KVBudgetError):
        h.add("prompt-fits-total-does-not", list(range(20)), 20)  # 39 tokens = 10 blocks
    h.add("small", [1, 2, 3], 5)
    h.run()
    assert len(h.reqs["small"].output_token_ids) == 5
    h.assert_idle()


def test_pool_pinned_at_100_percent_evicts_and_reuses_cached_blocks():
    h = Harness(10, 4)  # 40 token slots
    evictions = []  # prefix-cache hit tokens so far, at each eviction
    pool = h.sched.kv.pool
    evict = pool._evict

    def hits() -> int:
        return h.sched.stats()["prefix_cache_hit_tokens"]

    pool._evict = lambda block: (evictions.append(hits()), evict(block))
    systems = [[11, 12, 13, 14, 15, 16, 17, 18], [21, 22, 23, 24, 25, 26, 27, 28]]
    for i in range(12):
        h.add(f"r{i}", systems[i % 2] + [i + 1, i + 2, i + 3, i + 4], 8)
    h.run()
    h.assert_idle()  # outputs equal the unbounded oracle
    assert h.peak_usage == 1.0 and evictions
    assert hits() > evictions[0]  # cached blocks still re-used after eviction began


def test_preemption_of_the_newest_and_resume_rehits_the_prefix():
    h = Harness(6, 4)  # each request grows to 8 + 11 = 19 KV tokens = 5 blocks; 2 x 5 > 6
    a = h.add("a", [1, 2, 3, 4, 5, 6, 7, 8], 12)
    b = h.add("b", [9, 10, 11, 12, 13, 14, 15, 16], 12)
    preempted = []
    while h.sched.has_unfinished_requests():
        out = h.step()
        preempted += [s.request_id for s in out.preempted]
        if out.preempted:
            assert h.sched.waiting[0] is b and b.block_table == []
    assert preempted and set(preempted) == {"b"}  # never the older request
    assert a.num_preemptions == 0 and b.num_preemptions >= 1
    assert b.num_cached_tokens == 0  # first-admission figure is kept
    assert h.sched.stats()["num_preemptions"] == len(preempted)
    stats = h.sched.stats()
    assert stats["prefix_cache_rehit_tokens"] >= 4  # b's first block survived
    # issue 14: each prompt token queried once; re-admissions (prompt + output) apart
    assert stats["prefix_cache_queried_tokens"] == 16 and stats["prefix_cache_hit_tokens"] == 0
    assert stats["prefix_cache_requeried_tokens"] > 8 * len(preempted)
    h.assert_idle()


def test_fcfs_without_head_of_line_blocking():
    h = Harness(10, 4)
    h.add("a", list(range(20)), 8)  # 5 blocks now
    h.add("b", list(range(100, 124)), 4)  # needs 6 blocks, 5 free: skipped
    h.add("c", [1, 2, 3, 4], 4)  # 1 block: admitted past b
    assert ids(h.step()) == [("a", 20), ("c", 4)]
    h.run()
    h.assert_idle()


def test_a_passed_over_request_stops_admission_behind_it(monkeypatch):
    """Starvation guard: after HEAD_SKIP_LIMIT skips for lack of blocks, nothing behind the
    skipped request is admitted until it is; it then runs."""
    monkeypatch.setattr(scheduler_module, "HEAD_SKIP_LIMIT", 3)
    h = Harness(10, 4)
    h.add("a", list(range(24)), 6)  # 6 blocks, growing to ceil(29 / 4) = 8
    head = h.add("head", list(range(100, 120)), 2)  # needs 5 blocks: waits for a
    admitted_behind, skips = [], 0
    for step in range(40):
        h.add(f"s{step}", [step % 40 + 1, 7], 2)  # 1 block each: always fits a free block
        out = h.step()
        if head.status is not RequestStatus.WAITING:
            break
        skips += 1
        admitted_behind.append(any(c.request.request_id.startswith("s") for c in out.chunks))
    assert head.status is not RequestStatus.WAITING
    assert admitted_behind[0]  # no head-of-line blocking at first
    assert skips >= 3 and not any(admitted_behind[3:])  # then the guard holds the line
    h.run()
    h.assert_idle()


def test_long_requests_are_capped_to_their_share():
    h = Harness(20, 4, long_prompt_tokens=16, long_kv_share=0.5)  # longs hold <= 10 blocks
    for i in range(4):
        h.add(f"long{i}", [i + 1] * 20, 8)  # 5 blocks each, growing to ceil(27 / 4) = 7
    for i in range(6):
        h.add(f"short{i}", [i + 1, 2, 3, 4], 8)
    out = h.step()
    assert {r for r, _ in ids(out)} == {"long0", "long1"} | {f"short{i}" for i in range(6)}
    h.run()
    assert h.max_long_blocks == 10
    h.assert_idle()
    with pytest.raises(KVBudgetError, match="long-request share"):
        h.add("too-long", list(range(40)), 4)  # 43 tokens = 11 blocks > 10


def test_per_request_quota():
    h = Harness(100, 4, max_kv_tokens_per_request=32)
    with pytest.raises(KVBudgetError, match="quota of 32 tokens"):
        h.add("a", list(range(30)), 3)  # 30 + 3 = 33 > 32
    h.add("b", list(range(29)), 3)  # 32: allowed
    h.run()
    h.assert_idle()


def test_a_lone_request_that_outgrows_the_pool_fails_instead_of_looping():
    h = Harness(2, 4)  # 8 slots
    req = h.add("a", [1, 2, 3], 4)  # fits: 6 KV tokens
    req.max_tokens_effective = 10  # the engine let it run further than admitted
    failed = []
    while h.sched.has_unfinished_requests():
        failed += h.step().failed
    assert [(s.request_id, s.num_computed_tokens) for s, _ in failed] == [("a", 8)]
    h.assert_idle()


# ---------------------------------------------------------------------------- properties

configs = st.fixed_dictionaries(
    {
        "token_slots": st.integers(16, 100),  # pool size in tokens, rounded up to blocks
        "block_size": st.sampled_from([1, 2, 4, 8]),
        "max_num_batched_tokens": st.integers(1, 48),
        "max_num_seqs": st.integers(1, 12),
        "enable_prefix_caching": st.booleans(),
        "long_prompt_tokens": st.none() | st.integers(4, 24),
        "long_kv_share": st.floats(0.3, 1.0),
        "max_kv_tokens_per_request": st.one_of(st.none(), st.none(), st.integers(8, 80)),
    }
)
requests = st.tuples(
    st.integers(0, 2),  # prefix family
    st.integers(1, 30),  # prompt length
    st.integers(1, 12),  # max_tokens
    st.booleans(),  # ignore_eos
    st.sampled_from([None, "s"]),  # cache salt
)
operations = st.lists(
    st.one_of(
        st.tuples(st.just("add"), requests),
        st.tuples(st.just("add"), requests),
        st.tuples(st.just("step"), st.integers(1, 4)),
        st.tuples(st.just("abort"), st.integers(0, 40)),
    ),
    min_size=4,
    max_size=40,
)
FAMILIES = [[3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5, 8], [2, 7, 1, 8, 2, 8], []]


def build(cfg: dict) -> Harness:
    cfg = dict(cfg)
    bs = cfg.pop("block_size")
    return Harness(-(-cfg.pop("token_slots") // bs), bs, **cfg)


def add_checked(h: Harness, rid: str, request: tuple) -> None:
    """Add a request; KVBudgetError exactly when the hand oracle says it can never fit."""
    family, length, max_tokens, ignore_eos, salt = request
    prompt = (FAMILIES[family] + [int(rid[1:]) + 10] * length)[:length]
    cfg, num_blocks = h.config, h.sched.kv.pool.num_blocks
    is_long = cfg.long_prompt_tokens is not None and length >= cfg.long_prompt_tokens
    cap = int(cfg.long_kv_share * num_blocks) if is_long else num_blocks
    quota = cfg.max_kv_tokens_per_request
    blocks = -(-(length + max_tokens - 1) // h.bs)  # the last token is never cached
    never_fits = (quota is not None and length + max_tokens > quota) or blocks > cap
    try:
        h.add(rid, prompt, max_tokens, salt, ignore_eos)
        assert not never_fits
    except KVBudgetError:
        assert never_fits


def report(h: Harness) -> None:
    stats = h.sched.stats()
    assert stats["kv_blocks_evictable"] <= stats["kv_blocks_total"]
    event(f"preempted: {stats['num_preemptions'] > 0}")
    event(f"prefix hit: {stats['prefix_cache_hit_tokens'] > 0}")
    event(f"pool was full: {h.peak_usage == 1.0}")


@settings(max_examples=300, deadline=None)
@given(cfg=configs, ops=operations)
def test_random_operations_keep_accounting_and_outputs(cfg, ops):
    """Interleaved add / step / abort, then drain: invariants every step, oracle outputs."""
    h = build(cfg)
    for n, (op, arg) in enumerate(ops):
        if op == "add":
            add_checked(h, f"r{n}", arg)
        elif op == "step":
            for _ in range(arg):
                h.step()
        elif h.sched.requests:
            live = sorted(h.sched.requests)
            h.abort(live[arg % len(live)])
            h.check_state()
    h.run()
    h.assert_idle()
    report(h)


@settings(max_examples=200, deadline=None)
@given(
    cfg=configs,
    burst=st.lists(requests, min_size=2, max_size=16),
    aborts=st.lists(st.tuples(st.integers(0, 30), st.integers(0, 40)), max_size=4),
)
def test_bursts_under_memory_pressure_drain(cfg, burst, aborts):
    """Everything submitted at once to a small pool (preemption, eviction), with aborts at
    random steps: no livelock, invariants every step, oracle outputs."""
    h = build(cfg)
    for n, request in enumerate(burst):
        add_checked(h, f"r{n}", request)
    for step in range(5000):
        if not h.sched.has_unfinished_requests():
            break
        for when, which in aborts:
            if when == step and h.sched.requests:
                live = sorted(h.sched.requests)
                h.abort(live[which % len(live)])
        h.step()
    h.run()
    h.assert_idle()
    report(h)
    target(float(h.sched.num_preemptions), label="preemptions")


def test_an_older_prefill_preempts_a_newer_decode_never_itself():
    # issue 14 (vLLM #25538): decodes are scheduled first and the victim search skipped
    # scheduled requests, so the older prefill A preempted itself while the newer decode B
    # kept its block. Pool: 3 blocks of 4; A holds 2 (8 of its 12 prompt tokens), B holds 1.
    from kvledger.engine.config import EngineConfig
    from kvledger.engine.request import Request, RequestStatus
    from kvledger.engine.sample.sampling_params import SamplingParams
    from kvledger.engine.sched.scheduler import Scheduler

    sched = Scheduler(EngineConfig(block_size=4, enable_prefix_caching=False), 3, 4, 1000, 64)
    a = Request("a", list(range(1, 13)), SamplingParams(max_tokens=1))
    b = Request("b", [20, 21, 22], SamplingParams(max_tokens=2))
    for req, computed in ((a, 8), (b, 3)):
        sched.add(req)
        sched.waiting.remove(req)
        req.status = RequestStatus.RUNNING
        sched.running.append(req)
        assert sched.kv.allocate_slots(req, computed)
        req.num_computed_tokens = computed
    b.output_token_ids.append(7)  # B decodes next (one token, in its own block's slack)
    assert sched.kv.pool.num_free == 0
    out = sched.schedule()
    assert [r.request_id for r in out.preempted] == ["b"]
    assert [(c.request.request_id, c.num_new_tokens) for c in out.chunks] == [("a", 4)]
    assert a.status is RequestStatus.RUNNING and len(a.block_table) == 3
    assert b.block_table == [] and sched.waiting[0] is b


def _steps_until_first_token(h: Harness, name: str) -> int:
    steps = 0
    while not h.reqs[name].output_token_ids:
        h.step()
        steps += 1
    return steps


def test_a_short_prompt_behind_a_long_prefill_gets_its_first_token_at_the_next_step():
    """Old code (485cae7): the running prefill took the whole budget each step, so the short
    request waited for its 16 remaining chunks (the 12.4 s of issue 61's run)."""
    h = Harness(400, 4, max_num_batched_tokens=64)  # reserve: a quarter, 16 tokens
    h.add("long", list(range(1000, 2024)), 2)  # 1,024 tokens: 16 chunks of 64 alone
    assert ids(h.step()) == [("long", 64)]
    h.add("short", [1, 2, 3, 4, 5], 3)
    out = h.step()
    assert ids(out) == [("long", 48), ("short", 5)]  # the long one keeps 3/4 of the budget
    assert h.reqs["short"].output_token_ids  # sampled in that same step
    assert ids(h.step()) == [("short", 1), ("long", 63)]  # nothing waits: the whole budget
    h.run()
    h.assert_idle()


def test_new_prefill_tokens_0_keeps_first_come_first_served_chunks():
    h = Harness(400, 4, max_num_batched_tokens=64, new_prefill_tokens=0)
    h.add("long", list(range(1000, 2024)), 2)
    h.step()
    h.add("short", [1, 2, 3, 4, 5], 3)
    assert _steps_until_first_token(h, "short") == 16  # after the 15 chunks left, then its own
    h.run()
    h.assert_idle()


def test_each_waiting_short_prompt_starts_within_a_bounded_number_of_steps():
    """Several long prompts prefilling and more arriving: a short prompt samples its first token
    at most one step per request queued before it, plus one (each takes the reserve for its
    first chunk in turn). Old code: after every long prompt's last chunk (~94 steps)."""
    h = Harness(4000, 4, max_num_batched_tokens=64)
    for i in range(3):
        h.add(f"long{i}", list(range(5000 * (i + 1), 5000 * (i + 1) + 1500)), 2)
    h.step()
    h.add("long3", list(range(30000, 31500)), 2)
    h.add("short", [1, 2, 3, 4, 5], 3)
    assert _steps_until_first_token(h, "short") <= 3 + 1  # long1, long2, long3 queued before it
    h.run()
    h.assert_idle()
