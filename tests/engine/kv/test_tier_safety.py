"""The disk tier's directory cannot be turned against the host: nothing written, truncated or
deleted outside it through a symbolic link or a hard link, and no FIFO that blocks the start
or a load. Each test puts a decoy OUTSIDE the tier directory (a file that must keep its
content, a folder whose files must survive) or a FIFO under a block file's name (the start and
the load run in a thread with a timeout)."""

from __future__ import annotations

import logging
import os
import stat
import threading

import pytest
from test_tier_units import FP, block, disk_tier

from kvledger.engine.kv.tiers.tier_dir import open_tier_dir
from kvledger.errors import InvalidParameterError

SECRET = b"precious content, not the tier's\n"
TIMEOUT_S = 10


@pytest.fixture
def decoy(tmp_path):
    """A file outside the tier directory (``tmp_path / "tier"``) that must keep its content."""
    (tmp_path / "outside").mkdir()
    path = tmp_path / "outside" / "precious.txt"
    path.write_bytes(SECRET)
    return path


def sub_folder(root, block_hash: bytes):
    """The folder that holds ``block_hash``'s file (made)."""
    path = root / FP[:16] / block_hash.hex()[:2]
    path.mkdir(parents=True, exist_ok=True)
    return path


def in_thread(call):
    """``call()``'s result (or its exception), or a failure when it has not returned within
    TIMEOUT_S."""
    out = {}

    def target():
        try:
            out["result"] = call()
        except Exception as exc:  # noqa: BLE001 - raised again in the test's thread
            out["error"] = exc

    worker = threading.Thread(target=target, daemon=True)
    worker.start()
    worker.join(TIMEOUT_S)
    assert not worker.is_alive(), f"blocked for more than {TIMEOUT_S} s"
    if "error" in out:
        raise out["error"]
    return out["result"]


def unblock(fifo) -> None:
    """Open ``fifo``'s write end, which frees a reader blocked in ``open`` (old code)."""
    try:
        os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
    except OSError:
        pass


def test_a_symlinked_lock_is_refused_and_its_target_kept(tmp_path, decoy):
    root = tmp_path / "tier"
    root.mkdir()
    (root / "lock").symlink_to(decoy)
    with pytest.raises(InvalidParameterError, match=f"{root / 'lock'}.*symbolic link"):
        open_tier_dir(str(root))
    assert decoy.read_bytes() == SECRET


def test_a_hard_linked_lock_is_refused_and_its_other_name_kept(tmp_path, decoy):
    root = tmp_path / "tier"
    root.mkdir()
    os.link(decoy, root / "lock")
    with pytest.raises(InvalidParameterError, match=f"{root / 'lock'}.*other hard links"):
        open_tier_dir(str(root))
    assert decoy.read_bytes() == SECRET


def test_a_lock_that_is_not_a_regular_file_is_refused_by_name(tmp_path):
    root = tmp_path / "tier"
    root.mkdir()
    os.mkfifo(root / "lock")
    with pytest.raises(InvalidParameterError, match=f"{root / 'lock'}.*not a regular file"):
        in_thread(lambda: open_tier_dir(str(root)))


def test_the_write_check_does_not_follow_a_planted_symlink(tmp_path, decoy):
    root = tmp_path / "tier"
    root.mkdir()
    (root / f".write-check.{os.getpid()}").symlink_to(decoy)
    open_tier_dir(str(root)).close()
    assert decoy.read_bytes() == SECRET


def test_a_temp_file_name_planted_as_a_symlink_is_not_written_through(tmp_path, decoy):
    root = tmp_path / "tier"
    tier = disk_tier(root, 4)
    h, key, payload = block(1)
    (sub_folder(root, h) / f"{h.hex()}.kv.tmp{os.getpid()}").symlink_to(decoy)
    tier.put(h, key, payload)
    assert decoy.read_bytes() == SECRET
    assert tier.stats.write_errors == 1 and not tier.contains(h, key)


def test_start_up_does_not_walk_a_symlinked_sub_folder(tmp_path, caplog):
    """Old code: the leftover-temp-file and corrupt-file clean-up deleted both files."""
    outside = tmp_path / "outside"
    outside.mkdir()
    for name in ("half.kv.tmp7", "junk.kv"):
        (outside / name).write_bytes(SECRET)
    root = tmp_path / "tier"
    (root / FP[:16]).mkdir(parents=True)
    (root / FP[:16] / "zz").symlink_to(outside, target_is_directory=True)
    with caplog.at_level(logging.WARNING, "kvledger.kv_tier"):
        tier = disk_tier(root, 4)
    assert sorted(p.name for p in outside.iterdir()) == ["half.kv.tmp7", "junk.kv"]
    assert all(p.read_bytes() == SECRET for p in outside.iterdir())
    assert "zz" in caplog.text and "symbolic link" in caplog.text
    h, key, payload = block(1)
    tier.put(h, key, payload)  # the tier still works beside it
    assert bytes(tier.get(h, key)) == payload


def test_a_symlinked_fingerprint_folder_is_refused_at_start(tmp_path):
    outside = tmp_path / "outside"
    (outside / "ab").mkdir(parents=True)
    (outside / "ab" / "x.kv.tmp1").write_bytes(SECRET)
    root = tmp_path / "tier"
    root.mkdir()
    (root / FP[:16]).symlink_to(outside, target_is_directory=True)
    with pytest.raises(InvalidParameterError, match=f"{root / FP[:16]}.*symbolic link"):
        disk_tier(root, 4)
    assert (outside / "ab" / "x.kv.tmp1").read_bytes() == SECRET


def test_symlinked_block_files_are_skipped_and_their_targets_kept(tmp_path, decoy, caplog):
    root = tmp_path / "tier"
    h, _, _ = block(1)
    link = sub_folder(root, h) / f"{h.hex()}.kv"
    link.symlink_to(decoy)
    with caplog.at_level(logging.WARNING, "kvledger.kv_tier"):
        tier = disk_tier(root, 4)
    assert tier.stats.blocks == 0 and decoy.read_bytes() == SECRET
    assert link.is_symlink() and "not a regular file" in caplog.text


def test_a_sub_folder_swapped_for_a_symlink_loses_nothing_outside(tmp_path):
    """After start: a load that fails its checks, and an eviction, in a sub-folder that has
    become a symlink, delete nothing in the folder it points to."""
    root = tmp_path / "tier"
    tier = disk_tier(root, 2.5)
    blocks = [block(i) for i in range(1, 4)]
    for h, key, payload in blocks[:2]:
        tier.put(h, key, payload)
    outside = tmp_path / "outside"
    outside.mkdir()
    for h, _, _ in blocks[:2]:
        sub = sub_folder(root, h)
        if sub.is_symlink():
            continue
        for f in sub.iterdir():
            (outside / f.name).write_bytes(SECRET)  # the block files' names, other content
            f.unlink()
        sub.rmdir()
        sub.symlink_to(outside, target_is_directory=True)
    tier.put(*blocks[2])  # evicts block 1
    h2, key2, _ = blocks[1]
    assert tier.get(h2, key2) is None  # fails its checks: dropped from the index only
    assert sorted(p.name for p in outside.iterdir()) == sorted(
        f"{h.hex()}.kv" for h, _, _ in blocks[:2])
    assert all(p.read_bytes() == SECRET for p in outside.iterdir())


def test_a_fifo_named_like_a_block_file_blocks_neither_start_nor_load(tmp_path, caplog):
    root = tmp_path / "tier"
    h, key, payload = block(1)
    fifo = sub_folder(root, h) / f"{h.hex()}.kv"
    os.mkfifo(fifo)
    try:
        with caplog.at_level(logging.WARNING, "kvledger.kv_tier"):
            tier = in_thread(lambda: disk_tier(root, 4))
    finally:
        unblock(fifo)
    assert tier.stats.blocks == 0 and "not a regular file" in caplog.text
    assert stat.S_ISFIFO(fifo.lstat().st_mode)  # skipped, not removed
    fifo.unlink()
    tier.put(h, key, payload)
    assert tier.contains(h, key)
    fifo.unlink()
    os.mkfifo(fifo)  # the file becomes a FIFO after start
    try:
        assert in_thread(lambda: tier.get(h, key)) is None
        assert in_thread(lambda: tier.warm(h)) is False
    finally:
        unblock(fifo)
    assert fifo.exists()  # a FIFO is not a block file: never unlinked
