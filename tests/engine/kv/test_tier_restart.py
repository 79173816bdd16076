"""The disk and RAM KV tiers in the engine: a restart hits the disk tier for what the in-memory
prefix cache would give, a small pool hits the RAM tier, and a corrupt, truncated or foreign
block file is never used (fp32 greedy tokens equal a cold run's: the oracle is the engine
without any tier)."""

from __future__ import annotations

import random
import shutil
from functools import partial

import pytest
import torch
from tier_kit import finish

from kvledger.engine.config import EngineConfig
from kvledger.engine.engine import LLMEngine
from kvledger.engine.sample.sampling_params import SamplingParams
from kvledger.errors import InvalidParameterError
from kvledger.model.weights.loader import load_weights

GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
run = partial(finish, GREEDY)  # run(engine, prompt, request_id="r"): its final output
BS = 16


@pytest.fixture(scope="module")
def models(tiny_llama_folder):
    """Two tiny models of the same shape and different weights: name -> (folder, spec, weights)."""
    out = {}
    for name, seed in (("a", 0), ("b", 1)):
        folder = tiny_llama_folder(seed=seed)
        out[name] = (folder, *load_weights(folder, torch.float32))
    return out


@pytest.fixture
def build(models):
    engines = []

    def make(model="a", **options) -> LLMEngine:
        folder, spec, weights = models[model]
        options.setdefault("dtype", "fp32")
        engine = LLMEngine(EngineConfig(model=str(folder), **options), spec=spec,
                           weights=dict(weights))
        engines.append(engine)
        return engine

    yield make
    for engine in engines:
        engine.close()




def restart(engine, build, **options):
    """Close ``engine`` (its queued writes land) and build a fresh one on the same options."""
    engine.close()
    return build(**options)


PROMPT = [random.Random(3).randrange(3, 320) for _ in range(100)]  # 6 full blocks hit at most


def test_restart_hits_the_disk_tier_as_the_pool_would(build, tmp_path):
    opts = {"kv_disk_dir": str(tmp_path / "made" / "here"), "kv_disk_gib": 0.01}
    cold = run(build(), PROMPT)
    engine = build(**opts)
    first = run(engine, PROMPT)
    in_memory = run(engine, PROMPT, "again")  # the in-memory prefix cache, no restart
    assert in_memory.metrics.num_cached_tokens == (len(PROMPT) - 1) // BS * BS == 96
    assert in_memory.metrics.cached_tokens_by_tier == {"pool": 96, "ram": 0, "disk": 0}
    engine = restart(engine, build, **opts)
    after = run(engine, PROMPT)
    assert after.metrics.num_cached_tokens == in_memory.metrics.num_cached_tokens
    assert after.metrics.cached_tokens_by_tier == {"pool": 0, "ram": 0, "disk": 96}
    assert cold.token_ids == first.token_ids == in_memory.token_ids == after.token_ids
    disk = engine.tiers.chain.tiers[0].stats
    assert disk.hits == 6 and disk.corrupt_files == 0
    assert disk.bytes_read == 6 * engine.bytes_per_block


def test_ram_tier_serves_what_a_small_pool_evicted(build, tmp_path):
    rng = random.Random(9)
    other = [rng.randrange(3, 320) for _ in range(100)]
    cold = run(build(), PROMPT)
    engine = build(num_blocks=8, kv_ram_gib=0.001, kv_disk_dir=str(tmp_path))
    run(engine, PROMPT)
    run(engine, other, "evicts")  # 8 blocks: PROMPT's blocks leave the pool
    engine.tiers.chain.flush()
    again = run(engine, PROMPT, "again")
    by_tier = again.metrics.cached_tokens_by_tier
    assert by_tier["ram"] > 0 and sum(by_tier.values()) == again.metrics.num_cached_tokens
    assert again.token_ids == cold.token_ids
    ram, disk = engine.tiers.chain.tiers
    assert ram.name == "ram" and ram.stats.hits * BS == by_tier["ram"]
    assert disk.stats.blocks > 0  # written through to both tiers


def test_a_request_that_must_wait_loads_its_tier_blocks_once(build, tmp_path):
    """A 16-block pool; PROMPT's 6 full blocks are only in the RAM tier when it arrives behind
    a 200-token request that takes 13 blocks: it waits, and its blocks are loaded once, when
    the pool can hold it, not at every admission attempt (each evicted again before it runs)."""
    rng = random.Random(5)
    first = [rng.randrange(3, 320) for _ in range(200)]
    second = [rng.randrange(3, 320) for _ in range(190)]  # 12 blocks, a 13th as it decodes
    cold = run(build(), PROMPT)
    engine = build(num_blocks=16, kv_ram_gib=0.001)
    run(engine, PROMPT)
    run(engine, first, "evicts")  # 13 blocks: PROMPT's leave the pool
    engine.tiers.chain.flush()
    engine.add_request("long", second, GREEDY)
    waiting = run(engine, PROMPT, "waits")
    assert waiting.metrics.cached_tokens_by_tier == {"pool": 0, "ram": 96, "disk": 0}
    assert waiting.token_ids == cold.token_ids
    (ram,) = engine.tiers.chain.tiers
    assert ram.stats.hits == 6
    assert engine.stats()["kv_tier_deferred_loads"] > 0


def _block_files(tmp_path):
    return sorted(tmp_path.rglob("*.kv"))


def _flip(path, offset_from_end):
    data = bytearray(path.read_bytes())
    data[-offset_from_end] ^= 0xFF
    path.write_bytes(bytes(data))


def _truncate(path, _):
    path.write_bytes(path.read_bytes()[:-100])


def _header(path, _):
    data = bytearray(path.read_bytes())
    data[30] ^= 0x01  # inside the JSON header (fingerprint, key)
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("damage", [_flip, _truncate, _header])
@pytest.mark.parametrize("when", ["before start", "after start"])
def test_a_damaged_file_is_recomputed_and_counted(build, tmp_path, damage, when):
    opts = {"kv_disk_dir": str(tmp_path)}
    cold = run(build(), PROMPT)
    engine = build(**opts)
    run(engine, PROMPT)
    engine.close()
    files = _block_files(tmp_path)
    assert len(files) == 6
    target = files[2]  # some block of the prompt (files are named by block hash)
    if when == "before start":
        damage(target, 5)
        damaged = target.read_bytes()
        engine = build(**opts)  # a bad header is dropped here, a bad payload on load
    else:
        engine = build(**opts)
        damage(target, 5)
        damaged = target.read_bytes()
    after = run(engine, PROMPT)
    disk = engine.tiers.chain.tiers[0].stats
    assert disk.corrupt_files == 1
    assert after.token_ids == cold.token_ids
    assert after.metrics.num_cached_tokens < 96  # the chain stops at the damaged block
    engine.tiers.chain.flush()  # the recomputed block is written through again
    assert not target.exists() or target.read_bytes() != damaged  # the damage never stays


@pytest.mark.parametrize("when", ["before start", "after start"])
def test_files_swapped_between_two_models_are_never_used(build, tmp_path, when):
    cold_a = run(build("a"), PROMPT)
    dir_a, dir_b = tmp_path / "a", tmp_path / "b"
    for model, folder in (("a", dir_a), ("b", dir_b)):
        engine = build(model, kv_disk_dir=str(folder))
        run(engine, PROMPT)
        engine.close()
    (fp_a,), (fp_b,) = [[p for p in d.iterdir() if p.is_dir()] for d in (dir_a, dir_b)]
    assert fp_a.name != fp_b.name  # other weights, other fingerprint

    def swap():
        for src in fp_b.rglob("*.kv"):  # same tokens: same block hashes and file names
            dst = fp_a / src.relative_to(fp_b)
            assert dst.exists()
            shutil.copyfile(src, dst)

    if when == "before start":
        swap()
        engine = build("a", kv_disk_dir=str(dir_a))
    else:
        engine = build("a", kv_disk_dir=str(dir_a))
        swap()
    after = run(engine, PROMPT)
    assert after.metrics.num_cached_tokens == 0
    assert after.token_ids == cold_a.token_ids
    assert engine.tiers.chain.tiers[0].stats.corrupt_files == 6 if when == "before start" else 1


def test_a_second_engine_on_the_directory_is_refused(build, tmp_path):
    build(kv_disk_dir=str(tmp_path))
    with pytest.raises(InvalidParameterError, match="in use by another kvledger process"):
        build(kv_disk_dir=str(tmp_path))


def test_quantized_blocks_survive_a_restart(build, tmp_path):
    opts = {"kv_disk_dir": str(tmp_path), "kv_cache_dtype": "int8"}
    engine = build(**opts)
    run(engine, PROMPT)
    in_memory = run(engine, PROMPT, "again")
    engine = restart(engine, build, **opts)
    after = run(engine, PROMPT)
    assert after.metrics.cached_tokens_by_tier["disk"] == 96
    assert after.token_ids == in_memory.token_ids  # the same int8 blocks, read back


def test_another_kv_format_does_not_see_the_blocks(build, tmp_path):
    engine = build(kv_disk_dir=str(tmp_path))
    run(engine, PROMPT)
    engine = restart(engine, build, kv_disk_dir=str(tmp_path), kv_cache_dtype="bf16")
    assert run(engine, PROMPT).metrics.num_cached_tokens == 0


def test_a_full_disk_turns_the_tier_off_and_serving_goes_on(build, tmp_path, monkeypatch,
                                                              caplog):
    import errno

    from kvledger.engine.kv.tiers.disk import DiskTier

    def full(path, data):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(DiskTier, "_write", staticmethod(full))
    cold = run(build(), PROMPT)
    engine = build(kv_disk_dir=str(tmp_path))
    out = run(engine, PROMPT)
    engine.tiers.chain.flush()
    disk = engine.tiers.chain.tiers[0].stats
    assert disk.disabled and disk.write_errors == 1
    assert "disk is full" in caplog.text
    assert out.token_ids == cold.token_ids
    assert run(engine, PROMPT, "again").metrics.cached_tokens_by_tier["pool"] == 96


def test_a_probed_read_speed_predicts_each_load(build, tmp_path, monkeypatch):
    from kvledger.ledger.tier_load import save_figures

    monkeypatch.setenv("KVLEDGER_CONFIG_DIR", str(tmp_path / "config"))
    opts = {"kv_disk_dir": str(tmp_path / "kv")}
    engine = build(**opts)
    run(engine, PROMPT)
    save_figures(tmp_path / "kv", {"cold_bytes_per_s": 1e9, "prefill_flops_per_s": 1.0},
                 tmp_path / "config")  # a prefill this slow: loading wins
    engine = restart(engine, build, **opts)
    m = run(engine, PROMPT).metrics
    assert m.cached_tokens_by_tier["disk"] == 96
    assert m.tier_load_predicted_s == pytest.approx(6 * engine.bytes_per_block / 1e9)
    assert m.tier_load_s > 0
    assert engine.stats()["kv_tier_recomputed_blocks"] == 0


def test_a_disk_slower_than_the_prefill_is_recomputed_not_loaded(build, tmp_path, monkeypatch):
    """A probed read speed of 1 B/s (both cold and warm) against any real prefill speed: the
    blocks found on disk are recomputed, counted, and the greedy tokens equal a cold run's."""
    from kvledger.ledger.tier_load import save_figures

    monkeypatch.setenv("KVLEDGER_CONFIG_DIR", str(tmp_path / "config"))
    opts = {"kv_disk_dir": str(tmp_path / "kv")}
    cold = run(build(), PROMPT)
    engine = build(**opts)
    run(engine, PROMPT)
    save_figures(tmp_path / "kv", {"cold_bytes_per_s": 1, "warm_bytes_per_s": 1,
                                   "prefill_flops_per_s": 1e9}, tmp_path / "config")
    engine = restart(engine, build, **opts)
    out = run(engine, PROMPT)
    assert out.metrics.cached_tokens_by_tier == {"pool": 0, "ram": 0, "disk": 0}
    assert out.metrics.tier_load_s == 0 and out.metrics.tier_load_predicted_s == 0
    assert engine.stats()["kv_tier_recomputed_blocks"] == 6
    assert out.token_ids == cold.token_ids
