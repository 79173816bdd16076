"""The KV tiers' parts alone: the block file's checks, the disk tier's LRU within its size and
its start-up index, the writer queue that drops instead of waiting, the directory refusals and
the layouts the tiers refuse."""

from __future__ import annotations

import os
import threading

import pytest

from kvledger.data import config_path
from kvledger.engine.config import EngineConfig
from kvledger.engine.kv.prefix import block_hash_key, hash_block_key
from kvledger.engine.kv.tiers import block_file
from kvledger.engine.kv.tiers.build import refuse_unsupported
from kvledger.engine.kv.tiers.chain import TierChain
from kvledger.engine.kv.tiers.disk import DiskTier
from kvledger.engine.kv.tiers.ram import RAMTier
from kvledger.engine.kv.tiers.tier_dir import open_tier_dir
from kvledger.errors import InvalidParameterError
from kvledger.model.families import load_spec

FP = "ab" * 32
PAYLOAD = 1000


def block(i: int, salt: str | None = None):
    key = block_hash_key(None, [i] * 16, (salt,) if salt else ())
    return hash_block_key(key), key, bytes([i % 256]) * PAYLOAD


def disk_tier(path, capacity_blocks: float) -> DiskTier:
    file_bytes = len(block_file.encode(FP, *block(0)))  # +- a few digits of the CRC
    return DiskTier(path, FP, int(capacity_blocks * file_bytes), PAYLOAD)


def test_block_file_round_trip_and_each_check():
    h, key, payload = block(1, salt="tenant-a")
    data = block_file.encode(FP, h, key, payload)
    header = block_file.parse_header(data, FP)
    assert (header.block_hash, header.key) == (h, key)
    assert bytes(block_file.check_payload(data, header, PAYLOAD)) == payload
    with pytest.raises(block_file.BlockFileError, match="fingerprint"):
        block_file.parse_header(data, "cd" * 32)
    with pytest.raises(block_file.BlockFileError, match="checksum"):
        bad = bytearray(data)
        bad[-1] ^= 1
        block_file.check_payload(bytes(bad), header, PAYLOAD)
    with pytest.raises(block_file.BlockFileError, match="file of"):
        block_file.check_payload(data[:-1], header, PAYLOAD)
    with pytest.raises(block_file.BlockFileError, match="a block holds"):
        block_file.check_payload(data, header, PAYLOAD + 1)
    forged = data.replace(b'"tenant-a"', b'"tenant-b"')  # another salt, same hash
    with pytest.raises(block_file.BlockFileError, match="does not hash"):
        block_file.parse_header(forged, FP)
    with pytest.raises(block_file.BlockFileError, match="not a kvledger"):
        block_file.parse_header(b"x" * 64, FP)


def test_disk_tier_evicts_least_recently_used_within_its_size(tmp_path):
    tier = disk_tier(tmp_path, 3.5)
    for i in range(3):
        tier.put(*block(i))
    assert tier.get(*block(0)[:2]) is not None  # 0 is now the most recent
    tier.put(*block(3))  # evicts 1, the least recently used
    held = [i for i in range(4) if tier.contains(*block(i)[:2])]
    assert held == [0, 2, 3]
    assert len(list(tmp_path.rglob("*.kv"))) == 3
    assert tier.stats.bytes_held <= tier.stats.capacity_bytes


def test_start_up_rebuilds_the_index_from_headers_in_lru_order(tmp_path):
    tier = disk_tier(tmp_path, 3.5)
    for i in range(3):
        tier.put(*block(i))
    tier.get(*block(0)[:2])  # touches the file: most recent, also after a restart
    stale = tier.path(block(9)[0]).with_name("left.kv.tmp123")
    stale.parent.mkdir(exist_ok=True)
    stale.write_bytes(b"half a write")
    again = disk_tier(tmp_path, 3.5)
    assert all(again.contains(*block(i)[:2]) for i in range(3))
    assert not stale.exists()
    assert bytes(again.get(*block(2)[:2])) == block(2)[2]
    again.put(*block(4))  # evicts 1, not 0
    assert not again.contains(*block(1)[:2]) and again.contains(*block(0)[:2])


def test_a_file_under_another_blocks_name_is_dropped_at_start(tmp_path):
    tier = disk_tier(tmp_path, 4)
    tier.put(*block(1))
    tier.put(*block(2))
    os.replace(tier.path(block(1)[0]), tier.path(block(2)[0]))
    again = disk_tier(tmp_path, 4)
    assert again.stats.corrupt_files == 1 and again.stats.blocks == 0


class SlowTier(RAMTier):
    def __init__(self):
        super().__init__(1 << 30)
        self.gate = threading.Event()

    def put(self, *args):
        self.gate.wait()
        super().put(*args)


def test_a_full_write_queue_drops_and_counts_instead_of_waiting():
    slow = SlowTier()
    chain = TierChain([slow], queue_bytes=3 * PAYLOAD)
    results = [chain.offer(*block(i)) for i in range(10)]
    # bytes count as queued until written: the writer holds block 0 in the gated put
    assert results == [True] * 3 + [False] * 7 and chain.dropped_writes == 7
    slow.gate.set()
    chain.flush()
    assert slow.stats.blocks == 10 - chain.dropped_writes
    chain.close()


def test_directory_is_created_and_an_unwritable_one_refused(tmp_path):
    made = open_tier_dir(str(tmp_path / "x" / "y"))
    assert (tmp_path / "x" / "y" / "lock").read_text().strip() == str(os.getpid())
    made.close()
    blocker = tmp_path / "file"
    blocker.write_text("")
    with pytest.raises(InvalidParameterError, match="cannot create or write"):
        open_tier_dir(str(blocker / "sub"))
    if os.geteuid() != 0:
        ro = tmp_path / "ro"
        ro.mkdir(mode=0o500)
        with pytest.raises(InvalidParameterError, match="cannot"):
            open_tier_dir(str(ro))


def test_second_holder_of_a_directory_is_refused_and_the_lock_freed_on_close(tmp_path):
    first = open_tier_dir(str(tmp_path))
    with pytest.raises(InvalidParameterError, match=f"pid {os.getpid()}"):
        open_tier_dir(str(tmp_path))
    first.close()
    open_tier_dir(str(tmp_path)).close()


@pytest.mark.parametrize("name", ["google__gemma-2-9b", "google__gemma-3-1b-it",
                                  "microsoft__Phi-3.5-mini-instruct"])
def test_sliding_window_layouts_are_refused_by_name(name, tmp_path):
    spec = load_spec(config_path(name))
    with pytest.raises(InvalidParameterError, match=spec.model_type):
        refuse_unsupported(EngineConfig(kv_disk_dir=str(tmp_path)), spec)
    refuse_unsupported(EngineConfig(), spec)  # no tier, no refusal


def test_full_attention_layout_is_accepted_and_tp_refused(tmp_path):
    spec = load_spec(config_path("HuggingFaceTB__SmolLM2-135M"))
    refuse_unsupported(EngineConfig(kv_disk_dir=str(tmp_path)), spec)
    with pytest.raises(InvalidParameterError, match="tensor parallelism"):
        refuse_unsupported(EngineConfig(kv_disk_dir=str(tmp_path), tensor_parallel_size=2),
                           spec)
    with pytest.raises(InvalidParameterError, match="needs kv_disk_dir"):
        EngineConfig(kv_disk_gib=1)


def test_read_probe_times_the_load_path_and_saves_beside_the_prefill_speed(tmp_path):
    from kvledger.engine.kv.tiers import read_probe
    from kvledger.ledger.tier_load import ReadSpeed, save_figures, saved_figures

    spec = load_spec(config_path("HuggingFaceTB__SmolLM2-135M"))
    tensor_bytes = read_probe.store_tensor_bytes(spec)
    # K or V of one layer: 3 KV heads x 16 tokens x 64 x 2 bytes, 30 layers
    assert tensor_bytes == [3 * 16 * 64 * 2] * 60
    figures = read_probe.measure_read(tmp_path / "tier", [4096, 4096], files=4)
    assert (figures["files"], figures["payload_bytes"]) == (4, 8192)
    for state in ("cold", "warm"):
        assert figures[f"{state}_bytes_per_s"] > 0 and figures[f"{state}_file_s"] >= 0
    assert list((tmp_path / "tier").iterdir()) == []  # the scratch files are gone
    save_figures(tmp_path / "tier", figures | {"prefill_flops_per_s": 5e9}, tmp_path / "config")
    saved = saved_figures(tmp_path / "tier", tmp_path / "config")
    assert saved.cold == ReadSpeed(figures["cold_bytes_per_s"], figures["cold_file_s"])
    assert saved.warm == ReadSpeed(figures["warm_bytes_per_s"], figures["warm_file_s"])
    assert saved.prefill_flops_per_s == 5e9
    other = saved_figures(tmp_path / "other", tmp_path / "config")
    assert (other.cold, other.warm, other.prefill_flops_per_s) == (None, None, None)


def test_the_read_probe_fit_recovers_a_known_line():
    """Seconds per file = 50 µs + bytes / 1 GB/s at two sizes: the fit gives both back."""
    from kvledger.engine.kv.tiers.read_probe import _fit

    speed = _fit(400_000, 50e-6 + 400_000 / 1e9, 50_000, 50e-6 + 50_000 / 1e9)
    assert speed.bytes_per_s == pytest.approx(1e9) and speed.file_s == pytest.approx(50e-6)
    # a noisy pair with no positive per-file time: all of it per byte
    assert _fit(400_000, 1e-4, 50_000, 2e-4).bytes_per_s == pytest.approx(4e9)


def test_load_policy_predicts_warm_and_cold_files_and_the_prefill_from_the_ledger():
    from kvledger.engine.kv.tiers.link import LoadPolicy
    from kvledger.ledger.params import count_params
    from kvledger.ledger.tier_load import ReadSpeed

    spec = load_spec(config_path("HuggingFaceTB__SmolLM2-135M"))
    active = count_params(spec).active
    policy = LoadPolicy(ReadSpeed(1e8, 1e-3), ReadSpeed(1e9), 1e10, spec, active)
    # 2 warm blocks at 1 GB/s, 3 cold ones at 0.1 GB/s + 1 ms each, 368,640 bytes per block
    assert policy.load_seconds(368_640, 2, 3) == pytest.approx(
        2 * 368_640 / 1e9 + 3 * (1e-3 + 368_640 / 1e8))
    # tokens [32, 96): 64 tokens x 2 x active params, plus the (query, key) pairs of queries
    # 33..96 (each sees its position's keys): 30 layers x 2 x 9 heads x (64 + 64) per pair
    pairs = sum(range(33, 97))
    flops = 64 * 2 * active + 30 * 2 * 9 * 128 * pairs
    assert policy.recompute_seconds(32, 96) == pytest.approx(flops / 1e10)
    assert policy.loads(0.1, 0.2) and not policy.loads(0.2, 0.1)
    assert LoadPolicy().load_seconds(368_640, 1, 1) is None  # no speeds known: always load
    assert LoadPolicy().recompute_seconds(0, 16) is None and LoadPolicy.loads(None, 1.0)


def test_the_fingerprint_sees_nope_and_the_multipliers():
    """A model without RoPE, or with µP multipliers (Granite), stores other K / V bytes from the
    same weights: its fingerprint differs from the plain model's, which stays as it was."""
    from kvledger.engine.kv.tiers.fingerprint import fingerprint

    spec = load_spec(config_path("meta-llama__Llama-3.2-1B"))

    def fp(s) -> str:
        return fingerprint(weights="w", dtype="bf16", weight_formats={}, device="cpu", spec=s,
                           kv_format_json="{}", outliers=None, block_size=16, tp_size=1,
                           tp_rank=0)

    plain = fp(spec)
    assert plain == fp(spec.with_fields(position_embedding_type="rope"))
    assert len({plain, fp(spec.with_fields(position_embedding_type="nope")),
                fp(spec.with_fields(embedding_multiplier=12.0)),
                fp(spec.with_fields(attention_multiplier=0.0078125))}) == 4
