"""Per-(layer, KV head) token selection of h2o and snapkv (tiny random Llama, fp32, GQA 4:2,
3 layers: 6 rows).

Oracles: transformers on the same weights with a mask per layer and KV head built from the
positions each row held before each step (every key kept, the others hidden); transformers'
own attention probabilities (eager) for which prompt tokens SnapKV keeps per head; hand-set
K/V whose values name their (position, head) for the compaction's copies; the policy's
per-sequence answer row by row for the batched decision.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from retention_reference import eager_attentions, held_masks, per_head_mask_logprobs
from retention_run import recorder, run

from kvledger.engine.kv.pool import BlockPool
from kvledger.engine.kv.store import KVStore
from kvledger.engine.retention.per_head import PerHeadKV
from kvledger.engine.retention.policies import make_policy
from kvledger.engine.sample.sampling_params import SamplingParams
from kvledger.ledger.retention import RetentionSpec

PROMPT = [(7 * i + 3) % 300 + 3 for i in range(21)]
LAYERS, KV_HEADS = 3, 2
SMALL = {
    "h2o": {"policy": "h2o", "budget": 14, "window": 4, "sinks": 2},
    "snapkv": {"policy": "snapkv", "budget": 12, "snapkv_window": 4, "snapkv_kernel": 3},
}


@pytest.mark.parametrize("name", sorted(SMALL))
def test_per_head_logits_equal_the_per_head_mask_only_reference(sharp_llama,
                                                                sharp_engine_factory, name):
    """Token-exact per head: every generated logprob equals transformers with each layer's
    and KV head's own mask of what that row held (1e-4); the rows did choose differently, and
    per-sequence selection gives other logprobs (so the test tells the two apart)."""
    _, hf = sharp_llama
    engine = sharp_engine_factory(block_size=4, num_blocks=64, max_num_batched_tokens=9)
    states = [(0, torch.zeros(LAYERS * KV_HEADS, 0, dtype=torch.int64))]
    out = run(engine, PROMPT, 30, SMALL[name], recorder(states), logprobs=2)
    tokens = PROMPT + out.token_ids
    allowed = held_masks(states, len(tokens) - 1, LAYERS, KV_HEADS)
    ref = per_head_mask_logprobs(hf, tokens[:-1], allowed)
    for i, lp in enumerate(out.logprobs):
        row = ref[len(PROMPT) - 1 + i]
        assert float(row[lp.token_id]) >= float(row.max()) - 1e-4, i  # greedy, near-ties apart
        got = torch.tensor([lp.logprob] + [v for _, v in lp.top])
        want = row[[lp.token_id] + [t for t, _ in lp.top]]
        torch.testing.assert_close(got, want, atol=1e-4, rtol=0)
    rows = allowed.reshape(LAYERS * KV_HEADS, -1)
    assert any(not torch.equal(rows[0], r) for r in rows[1:])  # rows held different tokens
    seq = run(sharp_engine_factory(block_size=4, num_blocks=64, max_num_batched_tokens=9),
              PROMPT, 30, {**SMALL[name], "select": "per-sequence"}, logprobs=0)
    diff = max(abs(a.logprob - b.logprob) for a, b in zip(out.logprobs, seq.logprobs))
    assert diff > 1e-3


@pytest.mark.parametrize("select", ["per-head", "per-sequence"])
def test_snapkv_keeps_the_top_of_transformers_pooled_attention(tiny_llama, tiny_engine_factory,
                                                               select):
    """Which prompt tokens SnapKV keeps: per (layer, KV head) the top budget - w by
    transformers' own attention probabilities of the last w prompt queries, summed over the
    KV head's query heads and pooled (kernel 3, zero padding), plus the w; per sequence, the
    same summed over every layer and head."""
    _, hf = tiny_llama
    spec = RetentionSpec.from_dict({**SMALL["snapkv"], "select": select})
    attn = eager_attentions(hf, PROMPT)
    w, n = spec.snapkv_window, len(PROMPT)
    votes = torch.stack([a[0, :, n - w:, :].sum(1) for a in attn])  # [layers, heads, n]
    votes = votes.view(LAYERS, KV_HEADS, -1, n).sum(2).reshape(-1, n)  # [rows, n]
    if select == "per-sequence":
        votes = votes.sum(0, keepdim=True)
    pooled = F.avg_pool1d(votes[:, None], spec.snapkv_kernel, 1, spec.snapkv_kernel // 2)[:, 0]
    states = []
    run(tiny_engine_factory(block_size=4, num_blocks=64), PROMPT, 3,
        {**SMALL["snapkv"], "select": select}, recorder(states))
    pos = states[-1][1]
    pos = pos.view(1, -1) if pos.dim() == 1 else pos
    for r in range(len(pooled)):
        kept = pos[r][(pos[r] >= 0) & (pos[r] < n)]
        assert len(kept) == spec.budget and set(range(n - w, n)) <= set(kept.tolist())
        chosen = torch.zeros(n, dtype=torch.bool)
        chosen[kept] = True
        chosen[n - w:] = False
        others = ~chosen
        others[n - w:] = False
        assert float(pooled[r][chosen].min()) >= float(pooled[r][others].max()) - 1e-6, r
    if select == "per-head":
        assert len({tuple(sorted(p[p < n].tolist())) for p in pos}) > 1


@pytest.mark.parametrize("name", sorted(SMALL))
def test_per_head_budget_blocks_and_bytes_equal_the_ledger(tiny_engine_factory, name):
    """Every row keeps the same count as the per-sequence run (h2o: capacity - 1 once full),
    its sinks/window and its newest token, each position once; the blocks are exactly
    ceil(held / block_size) (no holes between steps) and the pool's bytes and the ledger's
    agree at every step; all blocks free at idle."""
    spec = RetentionSpec.from_dict(SMALL[name])
    engine = tiny_engine_factory(block_size=4, num_blocks=64, max_num_batched_tokens=9)
    held_seen = []

    def check(e):
        stats = e.stats()
        for req in e.scheduler.running:
            pos = req.retention.pos
            assert pos.shape[0] == LAYERS * KV_HEADS and bool((pos >= 0).all())
            n = req.retention.num_held
            assert len(req.block_table) == -(-n // 4)
            newest = req.num_computed_tokens - 1
            for row in pos:
                assert row.unique().numel() == n and int(row.max()) == newest
                assert set(range(spec.sinks)) <= set(row.tolist())
            if spec.capacity is not None:
                assert n <= spec.capacity - 1
            held_seen.append((req.num_computed_tokens, n))
            assert stats["kv_bytes_predicted"] == n * e.bytes_per_token
            assert stats["kv_blocks_total"] - stats["kv_blocks_free"] == len(req.block_table)
            assert stats["kv_bytes_allocated"] == -(-n // 4) * e.bytes_per_block

    run(engine, PROMPT, 60, SMALL[name], check)
    seq_seen = []
    run(tiny_engine_factory(block_size=4, num_blocks=64, max_num_batched_tokens=9), PROMPT, 60,
        {**SMALL[name], "select": "per-sequence"},
        lambda e: [seq_seen.append((r.num_computed_tokens, r.retention.num_held))
                   for r in e.scheduler.running])
    assert held_seen == seq_seen and held_seen[-1][1] < held_seen[-1][0]
    if spec.capacity is not None:
        assert held_seen[-1][1] == spec.capacity - 1
    pool = engine.scheduler.kv.pool
    assert pool.num_free == pool.num_blocks


SHARED = [(11 * i + 5) % 300 + 3 for i in range(40)]


def test_warm_prefix_cache_equals_cold_and_shared_blocks_keep_their_bytes(tiny_engine_factory):
    """Per-head snapkv hitting a full request's prefix blocks (6 of them, before its
    observation window): the full request's blocks keep their K bytes at every step
    (compaction copies a shared block out before writing into it), and the snapkv output
    equals its run without the prefix cache (cold)."""
    snap = {**SMALL["snapkv"], "select": "per-head"}
    engine = tiny_engine_factory(block_size=4, num_blocks=96, max_num_seqs=2)
    engine.add_request("full", SHARED[:24] + [5], SamplingParams(max_tokens=40, temperature=0,
                                                                 ignore_eos=True))
    engine.step()
    held_blocks = list(engine.scheduler.requests["full"].block_table[:6])
    before = [t[held_blocks].clone() for t in engine.store.key_blocks]
    warm = run(engine, SHARED + [6], 30, snap, lambda e: [
        torch.testing.assert_close(t[held_blocks], b, atol=0, rtol=0)
        for t, b in zip(e.store.key_blocks, before)] if "full" in e.scheduler.requests else None)
    assert warm.metrics.num_cached_tokens == 24
    cold = run(tiny_engine_factory(block_size=4, num_blocks=96, enable_prefix_caching=False),
               SHARED + [6], 30, snap)
    assert warm.token_ids == cold.token_ids


def _store_naming_positions(rows_pos: torch.Tensor, table: list[int], bs: int) -> KVStore:
    """A 1-layer, 2-head store whose K/V at physical index j of head h is pos * 10 + h."""
    store = KVStore(1, 8, bs, 2, 2, torch.float32)
    for h in range(2):
        for j, p in enumerate(rows_pos[h].tolist()):
            slot = table[j // bs] * bs + j % bs
            store.key_blocks[0].view(-1, 2, 2)[slot, h] = p * 10 + h
            store.value_blocks[0].view(-1, 2, 2)[slot, h] = -(p * 10 + h)
    return store


def _held_state(n: int, pool: BlockPool, bs: int = 4) -> tuple[PerHeadKV, list[int]]:
    state = PerHeadKV(make_policy(RetentionSpec("snapkv", budget=40)), bs, 1, 2)
    state.append(0, n)
    return state, pool.allocate(-(-n // bs))


def test_compaction_moves_each_head_s_kept_tokens_and_copies_shared_blocks_first():
    """Rows dropping different positions (head 0: 1 and 9; head 1: 6 and 11): after reclaim
    every row holds indices [0, 10) with its own kept tokens, the K/V at each (index, head)
    name the position ``pos`` says, the table is 3 blocks, and block 0 (held by another
    table too) was copied out, never written."""
    bs, pool = 4, BlockPool(8)
    state, table = _held_state(12, pool)
    store = _store_naming_positions(state.pos, table, bs)
    pool.touch([table[0]])  # another sequence holds block 0
    shared = store.key_blocks[0][table[0]].clone()
    state.pos[0, [1, 9]] = -1
    state.pos[1, [6, 11]] = -1
    state._undo = (state.pos.clone(), state.scores.clone())
    new = state.reclaim(table, pool, store)
    assert len(new) == 3 and new[0] != table[0] and new[1:] == table[1:3]
    assert pool.num_free == 4  # 8 - 3 held - the shared block's fresh copy
    torch.testing.assert_close(store.key_blocks[0][table[0]], shared, atol=0, rtol=0)
    assert sorted(state.pos[0].tolist()) == [0, 2, 3, 4, 5, 6, 7, 8, 10, 11]
    assert sorted(state.pos[1].tolist()) == [0, 1, 2, 3, 4, 5, 7, 8, 9, 10]
    keys, values = store.key_blocks[0].view(-1, 2, 2), store.value_blocks[0].view(-1, 2, 2)
    for h in range(2):
        for j, p in enumerate(state.pos[h].tolist()):
            slot = new[j // bs] * bs + j % bs
            assert keys[slot, h].tolist() == [p * 10 + h] * 2
            assert values[slot, h].tolist() == [-(p * 10 + h)] * 2


def test_no_block_to_copy_a_shared_one_into_defers_the_eviction():
    """With a shared block to write and no free block, nothing moves: the table and K/V stay,
    every row holds its tokens again (the next step's eviction chooses anew)."""
    bs, pool = 4, BlockPool(3)
    state, table = _held_state(12, pool)
    store = _store_naming_positions(state.pos, table, bs)
    pool.touch([table[0]])
    keys = store.key_blocks[0].clone()
    state._undo = (state.pos.clone(), state.scores.clone())
    state.pos[0, 1] = -1
    state.pos[1, 2] = -1
    assert state.reclaim(table, pool, store) == table
    assert state.num_held == 12 and bool((state.pos >= 0).all())
    torch.testing.assert_close(store.key_blocks[0], keys, atol=0, rtol=0)


@pytest.mark.parametrize("spec", [RetentionSpec("h2o", budget=10, window=3, sinks=2),
                                  RetentionSpec("snapkv", budget=9, snapkv_window=3,
                                                snapkv_kernel=3)])
def test_batched_keep_decides_each_row_as_one_row_alone(spec):
    """The policy over [rows, h] equals the policy over each row, and rows keep equal counts."""
    torch.manual_seed(0)
    pos = torch.arange(20).repeat(6, 1)
    scores = torch.rand(6, 20)
    policy = make_policy(spec)
    batched = policy.keep(pos, scores, 20, 20, False)
    for r in range(6):
        assert torch.equal(batched[r], policy.keep(pos[r], scores[r], 20, 20, False))
    assert batched.sum(-1).unique().numel() == 1 and int(batched[0].sum()) < 20
