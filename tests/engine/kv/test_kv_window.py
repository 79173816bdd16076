"""Key groups over several blocks and the full-precision window (KIVI, arXiv 2402.02750).

Oracles: per-channel asymmetric quantization over G tokens written out here from the paper's
formula (scale = (max - min) / (2^b - 1), zero = min, both fp16); the written K/V themselves for
every token in the window (kept exactly, fp32); fp32 KV for an engine whose window covers the
whole sequence (nothing is ever quantized, so the greedy tokens are the same); self-consistency
(batch vs alone, the attention backends against each other).
"""

from __future__ import annotations

import pytest
import torch
from test_quantized_engine import _alone, _prompts, _run, tiny_engine_factory  # noqa: F401

from kvledger.engine.kv.codecs import GroupedKeys, make_codecs
from kvledger.engine.kv.quantized_store import QuantizedKVStore
from kvledger.ledger.kv_format import KVFormatSpec

BS, HEADS, DIM = 4, 2, 16


def _kivi_keys(x: torch.Tensor, bits: int) -> torch.Tensor:
    """x [G, H, D] quantized per channel over its G tokens and back (fp16 scale, zero)."""
    lo, hi = x.amin(0), x.amax(0)
    scale = ((hi - lo) / (2 ** bits - 1)).clamp_min(2.0 ** -14).half().float()
    zero = lo.half().float()
    codes = ((x - zero) / scale).round().clamp(0, 2 ** bits - 1)
    return codes * scale + zero


def _gathered(parts: dict[str, torch.Tensor], k: int) -> dict[str, torch.Tensor]:
    """Each block's group slices, as the store gathers them (blocks of a group consecutive)."""
    out = dict(parts)
    for name in ("scale", "zero"):
        t = parts[name]
        out[name] = t.view(-1, 1, k, *t.shape[1:]).expand(-1, k, -1, -1, -1).reshape(
            -1, k, *t.shape[1:])
    return out


@pytest.mark.parametrize("bits", [2, 3, 4])
def test_grouped_keys_equal_per_channel_quantization_over_the_group(bits):
    k, groups = 4, 3
    g = torch.Generator().manual_seed(1)
    x = torch.randn(groups * k, BS, HEADS, DIM, generator=g)
    x[..., 5] *= 30  # an outlier channel: its own scale
    codec = GroupedKeys(BS, HEADS, DIM, bits, k)
    parts = codec.encode(x)
    for name, (shape, dtype) in codec.fields().items():
        assert parts[name].shape == (groups * k, *shape) and parts[name].dtype == dtype
    # one scale and zero point per channel and group: D / k of them per block
    assert parts["scale"].shape[-1] == DIM // k
    back = codec.decode(_gathered(parts, k), torch.float32)
    want = torch.cat([_kivi_keys(x[i * k:(i + 1) * k].reshape(k * BS, HEADS, DIM), bits)
                      for i in range(groups)]).view_as(x)
    assert torch.allclose(back, want, atol=1e-5)


def _store(fmt: KVFormatSpec, seqs: int = 1, blocks: int = 64) -> QuantizedKVStore:
    k = fmt.key_group_blocks(BS)
    keys, values = make_codecs(fmt.name, BS, HEADS, DIM, 8, "per-channel", key_group_blocks=k)
    return QuantizedKVStore(1, blocks, BS, HEADS, DIM, fmt.name, keys, values, torch.float32,
                            seqs * fmt.reserved_blocks(BS), fmt=fmt)


@pytest.mark.parametrize("group, window, intact, step", [
    (8, 16, 0, 1), (8, 16, 0, 3), (4, 12, 0, 5), (16, 16, 0, 7),
    (8, 16, 8, 1), (8, 16, 16, 3), (4, 12, 12, 5), (16, 16, 32, 7)])
def test_the_window_and_intact_tokens_are_exact_and_sealed_groups_are_kivi_keys(
        group, window, intact, step):
    """Feed a sequence ``step`` tokens at a time through shuffled blocks, sealing what the
    runner seals (the final blocks less the intact ones, ``--kv-intact-tokens``): the intact
    tokens and the window read back exactly what was written at every step, each sealed key
    group after the intact tokens reads back as per-channel quantization over its G tokens,
    and the blocks held at full precision (buffers in use) are ``full_precision_blocks``."""
    fmt = KVFormatSpec("int2", key_group_tokens=group, residual_tokens=window,
                       intact_tokens=intact)
    store = _store(fmt)
    assert store.intact_blocks * BS == intact
    table = torch.randperm(64, generator=torch.Generator().manual_seed(2))
    g = torch.Generator().manual_seed(3)
    n = 70
    keys, values = (torch.randn(n, HEADS, DIM, generator=g) for _ in range(2))
    done = 0
    while done < n:
        new = min(step, n - done)
        lo = max(fmt.sealed_blocks(done, BS), fmt.intact_blocks(BS))
        hi = max(fmt.sealed_blocks(done + new, BS), lo)
        slots = table[torch.arange(done, done + new) // BS] * BS + torch.arange(done, done + new) % BS
        store.write(0, slots, keys[done:done + new], values[done:done + new], table[lo:hi])
        done += new
        used = -(-done // BS)
        got_k, got_v = (x.reshape(-1, HEADS, DIM)[:done] for x in
                        store.read_blocks(0, table[:used]))
        head = min(intact, done)
        assert torch.equal(got_k[:head], keys[:head]) and torch.equal(got_v[:head], values[:head])
        sealed = max(fmt.sealed_blocks(done, BS) * BS, head)
        assert torch.equal(got_k[sealed:], keys[sealed:done])
        assert torch.equal(got_v[sealed:], values[sealed:done])
        for start in range(intact, sealed, group):
            want = _kivi_keys(keys[start:start + group], 2)
            assert torch.allclose(got_k[start:start + group], want, atol=1e-5)
        assert not torch.equal(got_v[intact:sealed], values[intact:sealed]) or sealed <= intact
        assert int((store.residual_of >= 0).sum()) == fmt.full_precision_blocks(done, BS)
    assert fmt.sealed_blocks(n, BS) * BS > intact  # groups after the intact ones were sealed


def test_a_window_over_the_whole_sequence_equals_fp32_kv(tiny_engine_factory):  # noqa: F811
    """Nothing is sealed while a sequence is shorter than R: int2 then gives fp32's tokens."""
    prompts = _prompts(3, length=30)
    full = _run(tiny_engine_factory(num_blocks=64), prompts)
    int2 = tiny_engine_factory(num_blocks=64, kv_cache_dtype="int2", kv_residual_tokens=64)
    assert _run(int2, prompts) == full


@pytest.mark.parametrize("options", [
    {"kv_key_group_tokens": 64, "kv_residual_tokens": 64, "kv_intact_tokens": 0},
    {"kv_key_group_tokens": 32, "kv_residual_tokens": 48}])
def test_key_groups_over_blocks_cold_warm_batch_alone_and_backends_agree(
        tiny_engine_factory, options):  # noqa: F811
    """int2 with 64-token key groups (4 blocks) and a smaller group, prompts that
    share 100 tokens: later prompts hit whole sealed key groups only (64 or 96 tokens: the
    shared blocks 4-5 of a 4-block group are cached but not shared, their group's other
    blocks hold another prompt's tokens), and cold (no prefix cache), warm and alone agree on
    every backend when each request is fed in the same steps, a block per step (a prefill
    step reads its own tokens as computed, issue 58: a hit reads sealed blocks where the
    cold run's step from there reads them sealed too); a batch of one-step prefills gives the
    tokens of each prompt alone."""
    prompts = _prompts(3, length=140, shared=100)
    options = {"num_blocks": 64, "kv_cache_dtype": "int2", **options}
    ref = _alone(tiny_engine_factory(attention="reference", enable_prefix_caching=False,
                                     max_num_batched_tokens=16, **options), prompts)
    for backend in ("paged-torch", "paged-native"):
        engine = tiny_engine_factory(attention=backend, max_num_batched_tokens=16, **options)
        assert engine.config.enable_prefix_caching
        assert _alone(engine, prompts) == ref, backend
        hit = 64 if options["kv_key_group_tokens"] == 64 else 96
        assert engine.stats()["prefix_cache_hit_tokens"] == 2 * hit, backend
        assert _alone(engine, prompts, "w") == ref, backend
        assert engine.stats()["kv_blocks_free"] == 64
        uncached = tiny_engine_factory(attention=backend, enable_prefix_caching=False, **options)
        assert _run(uncached, prompts) == _alone(uncached, prompts), backend


def test_key_groups_over_blocks_under_eviction_and_reuse(tiny_engine_factory):  # noqa: F811
    """20 prompts (shared prefixes: hits, evictions of single blocks of a group, reuse)
    through 16 blocks give the tokens of an unbounded pool without a prefix cache. A token
    per step: a prefill step reads its own tokens as computed (issue 58), so a hit or a
    recomputed prompt reads what the cold run read only when both are fed in the same
    steps."""
    prompts = _prompts(10, length=70, shared=40) + _prompts(10, length=60, seed=9)
    options = {"kv_cache_dtype": "int2", "kv_key_group_tokens": 32, "kv_residual_tokens": 32,
               "max_num_batched_tokens": 1}
    cold = _run(tiny_engine_factory(num_blocks=400, enable_prefix_caching=False, **options),
                prompts)
    pinned = tiny_engine_factory(num_blocks=16, max_num_seqs=4, **options)
    assert _run(pinned, prompts) == cold
    stats = pinned.stats()
    # 16 blocks for 20 prompts of 4-5 blocks: cached blocks are evicted and reused; a token
    # per step admits one request at a time, so nothing is preempted (a preempted request's
    # recomputed prefill reads its tokens as computed, the cold run read them from the pool)
    assert stats["prefix_cache_hit_tokens"] > 0


def test_a_hit_ends_before_a_key_group_not_sealed_together():
    """``shareable``: whole groups whose blocks were sealed together, up to the first that
    is not (a block of another sealing, or one reused since)."""
    fmt = KVFormatSpec("int2", key_group_tokens=2 * BS, residual_tokens=2 * BS, intact_tokens=0)
    store = _store(fmt)
    g = torch.Generator().manual_seed(5)
    for group in ([3, 9], [4, 1], [7, 2]):  # three direct writes, each sealing one group
        slots = (torch.tensor(group)[:, None] * BS + torch.arange(BS)).flatten()
        store.write(0, slots, *(torch.randn(2 * BS, HEADS, DIM, generator=g) for _ in "kv"),
                    torch.tensor(group))
    assert store.shareable([3, 9, 4, 1, 7]) == 4  # a partial group is not shared
    assert store.shareable([3, 9, 4, 1, 7, 2]) == 6
    assert store.shareable([3, 9, 4, 2, 7, 1]) == 2  # 4 and 2 were not sealed together
    assert store.shareable([9, 3]) == 0  # out of order: not the group's layout


@pytest.mark.parametrize("options, message", [
    ({"kv_key_group_tokens": 24}, "--kv-key-group-tokens 24 must be a positive multiple"),
    ({"kv_key_group_tokens": 64, "kv_residual_tokens": 32},
     "--kv-residual-tokens 32 must be at least the key group of 64"),
    ({"kv_residual_tokens": 40}, "--kv-residual-tokens 40 must be a positive multiple"),
    ({"kv_key_group_tokens": 0}, "kv_key_group_tokens must be an integer in"),
])
def test_bad_key_group_or_window_is_refused(tiny_engine_factory, options, message):  # noqa: F811
    from kvledger.errors import InvalidParameterError

    with pytest.raises(InvalidParameterError, match=message):
        tiny_engine_factory(num_blocks=8, kv_cache_dtype="int2", **options)


@pytest.mark.parametrize("tier", ["kv_disk_dir", "kv_ram_gib"])
def test_kv_tiers_keep_the_defaults_and_explicit_key_groups(
        tiny_engine_factory, tmp_path, tier):  # noqa: F811
    """A tier stores a grouped block with its group's tag and an intact block's buffer
    (``tiers/payload.py``), so int2's defaults (keys over 32 tokens, 32 intact tokens, a
    window of 128) and an explicit key group stay as they are without a tier."""
    value = str(tmp_path) if tier == "kv_disk_dir" else 0.01
    fmt = tiny_engine_factory(num_blocks=8, kv_cache_dtype="int2", **{tier: value}).kv_layout.fmt
    plain = tiny_engine_factory(num_blocks=8, kv_cache_dtype="int2").kv_layout.fmt
    assert (fmt.key_group_tokens, fmt.intact_tokens, fmt.residual_tokens) == (32, 32, 128)
    assert fmt == plain
    value = str(tmp_path / "other") if tier == "kv_disk_dir" else 0.01
    fmt = tiny_engine_factory(num_blocks=8, kv_cache_dtype="int2", kv_key_group_tokens=64,
                              kv_intact_tokens=16, **{tier: value}).kv_layout.fmt
    assert (fmt.key_group_tokens, fmt.intact_tokens) == (64, 16)


def test_chunked_prefill_and_decode_keep_at_most_the_window_unsealed(tiny_engine_factory):  # noqa: F811
    """Prompts of 100 tokens prefilled 16 at a time, two sequences at once, decoded 10 steps:
    the store never needs more than R / block_size buffers per running sequence (it asserts
    so), every backend agrees, and every buffer is back once the requests are done."""
    prompts = _prompts(3, length=100)
    options = {"kv_cache_dtype": "int2", "kv_key_group_tokens": 32, "kv_residual_tokens": 48,
               "kv_intact_tokens": 0, "max_num_seqs": 2, "max_num_batched_tokens": 16,
               "num_blocks": 64}
    ref = _run(tiny_engine_factory(attention="reference", **options), prompts)
    for backend in ("paged-torch", "paged-native"):
        engine = tiny_engine_factory(attention=backend, **options)
        assert _run(engine, prompts) == ref, backend
        store = engine.store
        assert int((store.residual_of >= 0).sum()) == 0
        assert len(store._free_residuals) == 2 * 3  # max_num_seqs x R / block_size

