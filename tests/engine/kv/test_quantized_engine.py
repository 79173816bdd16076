"""Quantized KV in the engine (fp32 compute, tiny random Llama: head_dim 16, GQA 4:2).

Oracles: self-consistency (cold vs warm prefix cache, batch vs alone, preemption vs none, a
pinned pool with eviction and reuse vs an unbounded one: the same greedy tokens), the
attention backends against each other over the same quantized blocks (also Hadamard-rotated
ones: the native kernel rotates queries and output, the others read K/V rotated back), fp32
attention over the store's read-back, and the pool's tensor bytes against the ledger's figure
counted by hand (the same with rotation).
"""

from __future__ import annotations

import json
import random

import pytest
import torch

from kvledger.engine.sample.sampling_params import SamplingParams
from kvledger.errors import InvalidParameterError
from kvledger.ledger.kv import kv_bytes_per_block, residual_bytes
from kvledger.ledger.kv_format import KVFormatSpec

FORMATS = ["int8", "int4", "int3", "int2", "fp8"]
# int4 on every run, the other formats in the slow suite
SOME_SLOW = ["int4", "int3", "int2",
             *(pytest.param(f, marks=pytest.mark.slow) for f in ("int8", "fp8"))]
GREEDY = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def tiny_engine_factory(tiny_llama):
    """Engines over the tiny model; quantized KV is read by the native kernel unless a test
    names another backend (the module does not run once per backend)."""
    import torch

    from kvledger.engine.config import EngineConfig
    from kvledger.engine.engine import LLMEngine
    from kvledger.model.weights.loader import load_weights

    folder, _ = tiny_llama
    spec, weights = load_weights(folder, torch.float32)

    def build(**options):
        options.setdefault("attention", "paged-native")
        options.setdefault("dtype", "fp32")
        return LLMEngine(EngineConfig(model=str(folder), **options), spec=spec, weights=weights)

    return build


def _prompts(n, length=37, shared=0, seed=5):
    rng = random.Random(seed)
    prefix = [rng.randrange(3, 320) for _ in range(shared)]
    return [prefix + [rng.randrange(3, 320) for _ in range(length - shared + 3 * i)]
            for i in range(n)]


def _run(engine, prompts, tag="r"):
    for i, p in enumerate(prompts):
        engine.add_request(f"{tag}{i}", p, GREEDY)
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out.token_ids
    return [done[f"{tag}{i}"] for i in range(len(prompts))]


def _alone(engine, prompts, tag="a"):
    return [_run(engine, [p], f"{tag}{i}-")[0] for i, p in enumerate(prompts)]


# int3 / int2 with one-block key groups (groups over blocks: test_kv_window.py) and a
# window of two blocks: only sealed blocks are shared
PER_BLOCK = {"int4": {"kv_residual_tokens": 32},
             "int3": {"kv_key_group_tokens": 16, "kv_residual_tokens": 32},
             "int2": {"kv_key_group_tokens": 16, "kv_residual_tokens": 32}}


@pytest.mark.parametrize("fmt", FORMATS)
def test_cold_warm_batch_and_alone_agree(tiny_engine_factory, fmt):
    """A prefill step reads its own tokens as computed and earlier ones as the pool holds
    them (issue 58), so runs agree when each request is fed in the same steps: alone, a block
    per step, a prefix-cache hit (on a block boundary, sealed blocks only) reads what the
    cold run's step from there reads (a window of at most one key group and a block); and a
    batch of one-step prefills gives each prompt's tokens alone (no prefix cache)."""
    options = {"num_blocks": 64, "kv_cache_dtype": fmt, **PER_BLOCK.get(fmt, {})}
    engine = tiny_engine_factory(max_num_batched_tokens=16, **options)
    prompts = _prompts(4, shared=20)
    cold = _alone(engine, prompts)
    assert engine.stats()["prefix_cache_hit_tokens"] > 0  # prompts 2.. hit the shared block
    warm = _alone(engine, prompts, "w")
    assert cold == warm
    assert engine.stats()["kv_blocks_free"] == 64
    uncached = tiny_engine_factory(enable_prefix_caching=False, **options)
    assert _run(uncached, prompts, "b") == _alone(uncached, prompts)


@pytest.mark.parametrize("fmt", SOME_SLOW)
def test_preemption_and_a_pinned_pool_with_reuse_match_an_unbounded_pool(tiny_engine_factory,
                                                                         fmt):
    """20 prompts (shared prefixes, so hits, evictions and reuse of hashed blocks) through 12
    blocks: every reused block gets its own codes and scales."""
    prompts = _prompts(10, length=24, shared=17) + _prompts(10, length=21, seed=9)
    free = _run(tiny_engine_factory(num_blocks=400, kv_cache_dtype=fmt), prompts)
    pinned = tiny_engine_factory(num_blocks=12, kv_cache_dtype=fmt, max_num_seqs=4)
    assert _run(pinned, prompts) == free
    s = pinned.stats()
    assert s["num_preemptions"] > 0 or s["prefix_cache_hit_tokens"] > 0


@pytest.mark.parametrize("fmt", SOME_SLOW)
def test_backends_read_the_same_quantized_blocks(tiny_engine_factory, fmt):
    prompts = _prompts(3)
    ref = _run(tiny_engine_factory(num_blocks=64, kv_cache_dtype=fmt, attention="reference"),
               prompts)
    for backend in ("paged-torch", "paged-native"):
        engine = tiny_engine_factory(num_blocks=64, kv_cache_dtype=fmt, attention=backend)
        assert engine.model.attention.name == backend
        assert _run(engine, prompts) == ref, backend


def test_int8_keeps_most_greedy_tokens_of_fp32(tiny_engine_factory):
    prompts = _prompts(3)
    full = _run(tiny_engine_factory(num_blocks=64), prompts)
    int8 = _run(tiny_engine_factory(num_blocks=64, kv_cache_dtype="int8"), prompts)
    same = sum(a == b for x, y in zip(full, int8) for a, b in zip(x, y))
    assert same >= 0.8 * sum(map(len, full))


@pytest.mark.parametrize("fmt, options, per_head_block, window", [
    # tiny model: 3 layers x 2 KV heads, head_dim 16, 16-token blocks
    ("int8", {}, 2 * 16 * 16 + 16 * 1 * 4 + 16 * 4, 1),            # group 16 = head_dim
    # the defaults of int4 / int3 / int2: a window of 128 tokens (8 blocks) and 32 intact
    # tokens (2 blocks) held twice (the sequence's, a cached one's): 8 + 2 x 2
    ("int4", {"kv_key_quant": "per-token", "kv_group_size": 8}, 2 * 16 * 8 + 2 * 16 * 2 * 4,
     8 + 2 * 2),
    ("fp8", {}, 2 * 16 * 16 + 2 * 4, 1),
    # 8 codes in 3 bytes: 6 bytes per row; keys over 32 tokens by default (2 blocks): a block
    # holds 8 channels' scale and zero point
    ("int3", {}, 2 * 16 * 6 + 8 * 4 + 16 * 4, 8 + 2 * 2),
    ("int2", {}, 2 * 16 * 4 + 8 * 4 + 16 * 4, 8 + 2 * 2),
    # keys over 64 tokens (4 blocks: 4 channels each), the window the key group, no intact
    ("int2", {"kv_key_group_tokens": 64, "kv_residual_tokens": 64, "kv_intact_tokens": 0},
     2 * 16 * 4 + 4 * 4 + 16 * 4, 4),
    ("int2", {"kv_key_group_tokens": 32, "kv_residual_tokens": 128, "kv_intact_tokens": 0},
     2 * 16 * 4 + 8 * 4 + 16 * 4, 8),
    ("int3", {"kv_key_group_tokens": 16, "kv_residual_tokens": 16, "kv_intact_tokens": 0},
     2 * 16 * 6 + 16 * 4 + 16 * 4, 1),
    ("int4", {"kv_residual_tokens": 48, "kv_intact_tokens": 0}, 2 * 16 * 8 + 16 * 4 + 16 * 4, 3),
    # 32 intact tokens (2 blocks) held twice (the sequence's, a cached one's) beside R = 128
    ("int2", {"kv_key_group_tokens": 32, "kv_residual_tokens": 128, "kv_intact_tokens": 32},
     2 * 16 * 4 + 8 * 4 + 16 * 4, 8 + 2 * 2),
    # int4: 20 intact tokens round up to 2 one-block key groups
    ("int4", {"kv_intact_tokens": 20, "kv_residual_tokens": 16}, 2 * 16 * 8 + 16 * 4 + 16 * 4,
     1 + 2 * 2),
])
def test_pool_bytes_equal_ledger_bytes(tiny_engine_factory, fmt, options, per_head_block,
                                       window):
    """Bytes counted by hand = the ledger's = the pool's tensors, with the window's fp32
    blocks (R / block_size per running sequence, and twice the intact blocks) outside the
    blocks."""
    engine = tiny_engine_factory(num_blocks=37, kv_cache_dtype=fmt, max_num_seqs=5, **options)
    spec = engine.spec
    residual = 5 * window * 3 * 16 * 2 * 2 * 16 * 4  # max_num_seqs windows of fp32 blocks
    fmt_spec = KVFormatSpec(fmt, options.get("kv_group_size"),
                            options.get("kv_key_quant", "per-channel"),
                            residual_tokens=options.get("kv_residual_tokens"),
                            key_group_tokens=options.get("kv_key_group_tokens"),
                            intact_tokens=options.get("kv_intact_tokens"))
    assert engine.bytes_per_block == 3 * 2 * per_head_block == kv_bytes_per_block(
        spec, fmt_spec, 1, 16)
    assert engine.kv_layout.reserved_bytes == residual == 5 * residual_bytes(
        spec, fmt_spec, 1, 16, "fp32")
    assert engine.store.nbytes == 37 * engine.bytes_per_block + residual


@pytest.mark.slow
@pytest.mark.parametrize("fmt", ["int8", "int4", "fp8"])
def test_bundled_model_pool_bytes_equal_ledger_bytes(fmt):
    """SmolLM2-135M: 30 layers x 3 KV heads, head_dim 64; kv_cache_gib sizing less residual."""
    from kvledger import LLM
    from kvledger.ledger.costs import blocks_for
    from kvledger.ledger.kv import residual_bytes

    llm = LLM("default", dtype="fp32", kv_cache_dtype=fmt, kv_cache_gib=0.05, max_num_seqs=3)
    e = llm.engine
    residual = 3 * residual_bytes(e.spec, KVFormatSpec(fmt), 1, 16, "fp32")
    blocks = blocks_for(int(0.05 * 2**30) - residual,
                        kv_bytes_per_block(e.spec, KVFormatSpec(fmt), 1, 16))
    assert e.store.nbytes == blocks * e.bytes_per_block + residual
    assert e.stats()["kv_blocks_total"] == blocks


@pytest.mark.parametrize("options, message", [
    ({"kv_cache_dtype": "int4", "kv_group_size": 5}, "does not divide|divide head_dim"),
    ({"kv_cache_dtype": "int4", "kv_outlier_channels": 16}, r"\[0, head_dim 16\)"),
    ({"kv_cache_dtype": "bf16", "kv_outlier_channels": 2}, "quantized KV formats"),
    ({"kv_cache_dtype": "int8", "kv_outlier_channels": 2}, "needs a calibration"),
    ({"kv_cache_dtype": "int4", "kv_policy": "window", "kv_window": 32}, "full-precision KV"),
])
def test_bad_kv_options_are_refused(tiny_engine_factory, options, message):
    with pytest.raises(InvalidParameterError, match=message):
        tiny_engine_factory(num_blocks=8, **options)


def _calibration(spec, model, **over):
    data = {"kvledger_calibration": 1, "model": model, "num_layers": spec.num_layers,
            "num_kv_heads": spec.num_kv_heads, "head_dim": spec.head_dim,
            "key_absmax": [[[float(c) for c in range(spec.head_dim)]] * spec.num_kv_heads
                           ] * spec.num_layers}
    return {**data, **over}


def test_outlier_channels_from_a_calibration_file(tiny_engine_factory, tiny_llama, tmp_path):
    folder, _ = tiny_llama
    spec = tiny_engine_factory(num_blocks=1).spec
    good = tmp_path / "good.json"
    good.write_text(json.dumps(_calibration(spec, folder.name)))
    engine = tiny_engine_factory(num_blocks=40, kv_cache_dtype="int4", kv_outlier_channels=2,
                                 kv_calibration=str(good))
    assert engine.store.key_codecs[0].channels.tolist() == [[14, 15], [14, 15]]
    assert _run(engine, _prompts(2)) == _alone(engine, _prompts(2))
    other = tmp_path / "other.json"
    other.write_text(json.dumps(_calibration(spec, "some-other-model")))
    corrupt = tmp_path / "corrupt.json"
    corrupt.write_text("{not json")
    for path, message in ((other, "is for model"), (corrupt, "not a readable")):
        with pytest.raises(InvalidParameterError, match=message):
            tiny_engine_factory(num_blocks=8, kv_cache_dtype="int4", kv_outlier_channels=2,
                                kv_calibration=str(path))


@pytest.mark.parametrize("fmt", ["int8", "int4", "fp8"])
def test_pool_bytes_and_ledger_unchanged_by_rotation(tiny_engine_factory, fmt):
    plain = tiny_engine_factory(num_blocks=37, kv_cache_dtype=fmt, max_num_seqs=5)
    rotated = tiny_engine_factory(num_blocks=37, kv_cache_dtype=fmt, max_num_seqs=5,
                                  kv_rotation="hadamard")
    spec = plain.spec
    assert rotated.store.nbytes == plain.store.nbytes
    assert rotated.bytes_per_block == plain.bytes_per_block == kv_bytes_per_block(
        spec, KVFormatSpec(fmt, rotation="hadamard"), 1, 16)
    assert rotated.store.rotation is not None and plain.store.rotation is None


@pytest.mark.parametrize("fmt", ["int4", pytest.param("int8", marks=pytest.mark.slow), "fp8"])
def test_backends_agree_over_rotated_blocks(tiny_engine_factory, fmt):
    """paged-native rotates queries and output in the kernel; paged-torch and the reference
    read K/V rotated back by the store: the same greedy tokens."""
    prompts = _prompts(3)
    engines = {b: tiny_engine_factory(num_blocks=64, kv_cache_dtype=fmt, attention=b,
                                      kv_rotation="hadamard")
               for b in ("reference", "paged-torch", "paged-native")}
    ref = _run(engines.pop("reference"), prompts)
    for backend, engine in engines.items():
        assert engine.model.attention.name == backend
        assert _run(engine, prompts) == ref, backend


@pytest.mark.parametrize("fmt", ["int4", "int3", "int2"])
@pytest.mark.parametrize("rotation", ["none", "hadamard"])
def test_native_kernel_equals_fp32_attention_over_the_read_back(tiny_engine_factory, fmt,
                                                                rotation):
    """The kernel's output over a (rotated) store equals softmax attention computed in fp32
    from the store's (unrotated) read-back (``read_blocks``), within 1e-4: it decodes the
    format and the rotation itself, without falling back."""
    from kvledger.device.cpu import native
    from kvledger.engine.attention.metadata import PagedQueries

    engine = tiny_engine_factory(num_blocks=8, kv_cache_dtype=fmt, kv_rotation=rotation,
                                 kv_key_group_tokens=16)
    store, spec = engine.store, engine.spec
    n = 40  # two full blocks and a partial one
    g = torch.Generator().manual_seed(3)
    k, v = (torch.randn(n, spec.num_kv_heads, spec.head_dim, generator=g) for _ in range(2))
    k[..., 3] *= 20
    store.write(0, torch.arange(n), k, v)
    q = torch.randn(1, spec.num_attention_heads, spec.head_dim, generator=g)
    paged = PagedQueries(torch.tensor([[0, 1, 2]], dtype=torch.int32),
                         torch.tensor([0], dtype=torch.int32), torch.tensor([n], dtype=torch.int32))
    backend = engine.model.attention
    assert backend.name == "paged-native" and native.load() is not None
    assert backend.kernel.accepts_quantized(q, store) and backend._sides(store, 0) is not None
    out = backend.attend(0, q, paged, store)
    keys, values = (x.reshape(-1, *x.shape[2:])[:n] for x in store.read_blocks(0, torch.arange(3)))
    group = spec.num_attention_heads // spec.num_kv_heads
    keys, values = keys.repeat_interleave(group, 1), values.repeat_interleave(group, 1)
    p = torch.softmax(torch.einsum("hd,thd->ht", q[0], keys) * spec.head_dim ** -0.5, -1)
    want = torch.einsum("ht,thd->hd", p, values)
    assert torch.allclose(out[0], want, atol=1e-4)


@pytest.mark.parametrize("options, message", [
    ({"kv_cache_dtype": "bf16", "kv_rotation": "hadamard"}, "applies to quantized KV formats"),
    ({"kv_cache_dtype": "int4", "kv_rotation": "givens"}, "kv_rotation must be one of"),
])
def test_bad_rotation_options_are_refused(tiny_engine_factory, options, message):
    with pytest.raises(InvalidParameterError, match=message):
        tiny_engine_factory(num_blocks=8, **options)


def test_calibration_records_its_rotation_and_a_mismatch_is_refused(
        tiny_engine_factory, tiny_llama, tmp_path):

    folder, _ = tiny_llama
    spec = tiny_engine_factory(num_blocks=1).spec
    plain, rotated = tmp_path / "plain.json", tmp_path / "rotated.json"
    plain.write_text(json.dumps(_calibration(spec, folder.name)))
    rotated.write_text(json.dumps(_calibration(spec, folder.name, rotation="hadamard")))
    engine = tiny_engine_factory(num_blocks=40, kv_cache_dtype="int4", kv_outlier_channels=2,
                                 kv_calibration=str(rotated), kv_rotation="hadamard")
    assert engine.store.key_codecs[0].channels.tolist() == [[14, 15], [14, 15]]
    for path, rotation in ((plain, "hadamard"), (rotated, "none")):
        with pytest.raises(InvalidParameterError, match="was measured with rotation"):
            tiny_engine_factory(num_blocks=8, kv_cache_dtype="int4", kv_outlier_channels=2,
                                kv_calibration=str(path), kv_rotation=rotation)
