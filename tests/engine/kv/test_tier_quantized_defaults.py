"""The KV tiers at the quantized formats' defaults (keys grouped over 32 tokens for int3 /
int2, the first 32 tokens intact, a window of 128): a tier stores a grouped block with its
group's tag and an intact block's full-precision buffer rows, and restores them so that a hit
from the disk after a restart, or from the RAM tier after the pool evicted the blocks, reads
exactly what the in-memory prefix cache gives. The oracle is the same engine without any tier
(fp32 greedy tokens and their logprobs equal); a key group whose blocks come from two
sealings, or a damaged file, is never used."""

from __future__ import annotations

import random
import shutil
from functools import partial

import pytest
import torch
from tier_kit import finish

from kvledger.engine.config import EngineConfig
from kvledger.engine.engine import LLMEngine
from kvledger.engine.kv.prefix import block_hash_key, hash_block_key
from kvledger.engine.sample.sampling_params import SamplingParams
from kvledger.model.weights.loader import load_weights

GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, logprobs=0)
run = partial(finish, GREEDY)  # run(engine, prompt, request_id="r"): its final output
BS = 16
_rng = random.Random(4)
PROMPT = [_rng.randrange(3, 320) for _ in range(300)]
OTHER = [_rng.randrange(3, 320) for _ in range(300)]
LONG = [_rng.randrange(3, 320) for _ in range(450)]
# sealed at 300 tokens with R 128: G 32, 6 whole key groups = 12 blocks (the first 2 intact);
# int4's G of one block, (300 - 112) // 16 = 11 blocks
HIT = {"int2": 12 * BS, "int3": 12 * BS, "int4": 11 * BS}


@pytest.fixture(scope="module")
def model(tiny_llama_folder):
    folder = tiny_llama_folder(seed=0)
    return (folder, *load_weights(folder, torch.float32))


@pytest.fixture
def build(model):
    engines = []

    def make(**options) -> LLMEngine:
        folder, spec, weights = model
        engine = LLMEngine(EngineConfig(model=str(folder), dtype="fp32", **options),
                           spec=spec, weights=dict(weights))
        engines.append(engine)
        return engine

    yield make
    for engine in engines:
        engine.close()




def answer(out):
    return out.token_ids, [lp.logprob for lp in out.logprobs]


def pool_hit(build, fmt):
    """The engine without tiers: PROMPT, then PROMPT again from the in-memory prefix cache."""
    plain = build(kv_cache_dtype=fmt)
    cold = run(plain, PROMPT)
    hit = run(plain, PROMPT, "again")
    assert hit.metrics.num_cached_tokens == HIT[fmt]
    return plain, cold, hit


@pytest.mark.parametrize("fmt", ["int2", "int3", "int4"])
def test_a_restart_reads_the_blocks_the_pool_hit_reads(build, tmp_path, fmt):
    plain, cold, hit = pool_hit(build, fmt)
    opts = {"kv_cache_dtype": fmt, "kv_disk_dir": str(tmp_path)}
    engine = build(**opts)
    assert engine.kv_layout.fmt == plain.kv_layout.fmt  # the defaults, not a fallback
    assert answer(run(engine, PROMPT)) == answer(cold)
    engine.close()
    engine = build(**opts)
    after = run(engine, PROMPT)
    assert after.metrics.cached_tokens_by_tier == {"pool": 0, "ram": 0, "disk": HIT[fmt]}
    assert answer(after) == answer(hit)
    disk = engine.tiers.chain.tiers[0].stats
    assert disk.hits == HIT[fmt] // BS and disk.corrupt_files == 0


def test_the_ram_tier_restores_what_a_small_pool_evicted(build):
    _, _, hit = pool_hit(build, "int2")
    engine = build(kv_cache_dtype="int2", num_blocks=24, kv_ram_gib=0.01)
    run(engine, PROMPT)
    run(engine, OTHER, "evicts")  # 24 blocks: PROMPT's leave the pool
    engine.tiers.chain.flush()
    again = run(engine, PROMPT, "again")
    by_tier = again.metrics.cached_tokens_by_tier
    # the pool kept the intact blocks and the first key group, the RAM tier gives the rest
    assert by_tier == {"pool": 4 * BS, "ram": 8 * BS, "disk": 0}
    assert answer(again) == answer(hit)
    store = engine.store  # every buffer back once the pool drops the cached blocks
    engine.scheduler.kv.pool.evict_free_cached()
    assert int((store.residual_of >= 0).sum()) == 0


def _file(folder, index, prompt=PROMPT):
    """The block file of ``prompt``'s block ``index`` (files are named by block hash)."""
    parent = None
    for i in range(index + 1):
        parent = hash_block_key(block_hash_key(parent, prompt[i * BS:(i + 1) * BS], ()))
    (path,) = folder.rglob(f"{parent.hex()}.kv")
    return path


def test_a_key_group_of_two_sealings_is_never_paired(build, tmp_path):
    """Block 15 (the second of the group of blocks 14-15) from an engine that prefilled in
    chunks of 64 tokens: from token 192 on its steps read the blocks sealed before them
    quantized, so its deeper layers' keys, and the group's scales, differ from a one-chunk
    prefill's. A restart loads the blocks before that group only (LONG seals 22 blocks)."""
    dirs = {n: tmp_path / str(n) for n in (2048, 64)}
    for chunk, folder in dirs.items():
        engine = build(kv_cache_dtype="int2", kv_disk_dir=str(folder),
                       max_num_batched_tokens=chunk)
        run(engine, LONG)
        engine.close()
    mine, theirs = _file(dirs[2048], 15, LONG), _file(dirs[64], 15, LONG)
    assert mine.read_bytes() != theirs.read_bytes()
    shutil.copyfile(theirs, mine)
    engine = build(kv_cache_dtype="int2", kv_disk_dir=str(dirs[2048]))
    after = run(engine, LONG)
    assert after.metrics.cached_tokens_by_tier["disk"] == 14 * BS
    assert engine.tiers.chain.tiers[0].stats.corrupt_files == 0  # each file is sound


@pytest.mark.parametrize("index, kept", [(1, 1), (7, 6)])  # an intact block; a grouped one
def test_a_damaged_file_stops_the_hit_before_its_group(build, tmp_path, index, kept):
    opts = {"kv_cache_dtype": "int2", "kv_disk_dir": str(tmp_path)}
    engine = build(**opts)
    run(engine, PROMPT)
    engine.close()
    path = _file(tmp_path, index)
    data = bytearray(path.read_bytes())
    data[-40] ^= 0xFF
    path.write_bytes(bytes(data))
    engine = build(**opts)
    assert engine.kv_layout.intact_blocks == 2  # blocks 0-1, then groups of 2 blocks
    after = run(engine, PROMPT)
    assert after.metrics.cached_tokens_by_tier["disk"] == kept * BS
    assert engine.tiers.chain.tiers[0].stats.corrupt_files == 1
