"""DiskTier: full KV blocks as files, one per block, least recently used evicted first.

Files live at ``DIR/<fingerprint[:16]>/<hash[:2]>/<hash>.kv`` (``block_file.py``'s format), so
engines of different models or KV layouts never see each other's blocks. Writes are
crash-consistent: a temporary file, ``fsync``, ``rename`` over the final name, ``fsync`` of the
directory (a killed process loses at most the writes still queued; a leftover temporary file is
removed at start-up). Start-up reads only each file's header (:meth:`DiskTier.rebuild_index`):
its key and size go in the index, in modification-time order (a hit touches the file, so the
order survives a restart); a file whose header fails a check is removed and counted. The
payload's checksum is verified on every load. A full disk (``ENOSPC``) turns the tier off with
a log line (``stats.disabled``); serving goes on without it.
"""

from __future__ import annotations

import errno
import logging
import os
import threading
import time
from collections import OrderedDict
from pathlib import Path

from kvledger.engine.kv.tiers import block_file
from kvledger.engine.kv.tiers.block_file import BlockFileError
from kvledger.engine.kv.tiers.tier import TierStats

log = logging.getLogger("kvledger.kv_tier")
HEADER_READ_BYTES = 4096
PAGE_BYTES = 4096


class DiskTier:
    """Block files under ``root`` for one engine fingerprint, at most ``capacity_bytes`` of
    files.

    Args:
        root: the locked tier directory (``tier_dir.open_tier_dir``).
        fingerprint: the engine's fingerprint (hex).
        capacity_bytes: most bytes of block files kept (headers included).
        payload_bytes: bytes of one block's payload (the ledger's bytes per block).
    """

    name = "disk"

    def __init__(self, root: Path, fingerprint: str, capacity_bytes: int,
                 payload_bytes: int) -> None:
        self.fingerprint, self.payload_bytes = fingerprint, payload_bytes
        self.dir = Path(root) / fingerprint[:16]
        self.dir.mkdir(parents=True, exist_ok=True)
        self.stats = TierStats(capacity_bytes=capacity_bytes)
        self._index: OrderedDict[bytes, tuple[tuple, int]] = OrderedDict()  # LRU first
        self._lock = threading.Lock()
        self._clock = 0  # the last mtime set (ns): strictly increasing, so ties never reorder
        self.rebuild_seconds = self.rebuild_index()

    def path(self, block_hash: bytes) -> Path:
        h = block_hash.hex()
        return self.dir / h[:2] / f"{h}.kv"

    def rebuild_index(self) -> float:
        """Read every block file's header into the index (LRU order = mtime order); returns
        the seconds it took."""
        start = time.perf_counter()
        found = []
        for sub in os.scandir(self.dir):
            if not sub.is_dir():
                continue
            for entry in os.scandir(sub.path):
                if ".tmp" in entry.name:
                    os.unlink(entry.path)  # a write that never finished
                elif entry.name.endswith(".kv"):
                    found.append((entry.stat().st_mtime_ns, entry.path))
        found.sort()
        self._clock = found[-1][0] if found else 0
        for _, path in found:
            try:
                with open(path, "rb") as f:
                    header = block_file.parse_header(f.read(HEADER_READ_BYTES), self.fingerprint)
                if Path(path) != self.path(header.block_hash):
                    raise BlockFileError("file name is not its block hash")
            except (OSError, BlockFileError) as err:
                self._drop_file(Path(path), err)
                continue
            self._index[header.block_hash] = (header.key, header.file_bytes)
            self.stats.bytes_held += header.file_bytes
        self.stats.blocks = len(self._index)
        seconds = time.perf_counter() - start
        log.info("KV disk tier %s: %d blocks, %.1f MiB, index read in %.3f s", self.dir,
                 len(self._index), self.stats.bytes_held / (1 << 20), seconds)
        return seconds

    def _drop_file(self, path: Path, why: Exception) -> None:
        self.stats.corrupt_files += 1
        log.warning("KV disk tier: %s not used: %s", path.name, why)
        try:
            os.unlink(path)
        except OSError:
            pass

    def contains(self, block_hash: bytes, key: tuple) -> bool:
        if self.stats.disabled:
            return False
        with self._lock:
            entry = self._index.get(block_hash)
        return entry is not None and entry[0] == key

    def warm(self, block_hash: bytes) -> bool:
        """Whether the file's last page is in the page cache: a one-page read with
        ``RWF_NOWAIT``, which fails rather than wait for the disk (False on any error)."""
        try:
            fd = os.open(self.path(block_hash), os.O_RDONLY)
        except OSError:
            return False
        try:
            size = os.fstat(fd).st_size
            os.preadv(fd, [bytearray(PAGE_BYTES)], max(0, size - PAGE_BYTES), os.RWF_NOWAIT)
            return True
        except (OSError, AttributeError):  # not cached, unsupported, or no RWF_NOWAIT here
            return False
        finally:
            os.close(fd)

    def get(self, block_hash: bytes, key: tuple) -> memoryview | None:
        path = self.path(block_hash)
        try:
            with open(path, "rb") as f:
                data = bytearray(os.fstat(f.fileno()).st_size)
                f.readinto(data)
            header = block_file.parse_header(data, self.fingerprint)
            if header.block_hash != block_hash or header.key != key:
                raise BlockFileError("holds another block")
            block_file.check_payload(data, header, self.payload_bytes)
        except FileNotFoundError:
            self._forget(block_hash)
            return None
        except (OSError, BlockFileError) as err:
            self._forget(block_hash)
            self._drop_file(path, err)
            return None
        self._touch(path)
        with self._lock:
            if block_hash in self._index:
                self._index.move_to_end(block_hash)
        self.stats.bytes_read += header.payload_bytes
        return memoryview(data)[header.header_bytes:]

    def _touch(self, path: Path) -> None:
        """Set the file's mtime to a strictly later time than any set before: the LRU order
        that start-up reads back."""
        with self._lock:
            self._clock = max(time.time_ns(), self._clock + 1)
            stamp = self._clock
        try:
            os.utime(path, ns=(stamp, stamp))
        except OSError:
            pass

    def _forget(self, block_hash: bytes) -> None:
        with self._lock:
            entry = self._index.pop(block_hash, None)
            if entry is not None:
                self.stats.bytes_held -= entry[1]
                self.stats.blocks = len(self._index)

    def put(self, block_hash: bytes, key: tuple, payload: bytes) -> None:
        s = self.stats
        if s.disabled:
            return
        data = block_file.encode(self.fingerprint, block_hash, key, payload)
        if len(data) > s.capacity_bytes:
            return
        with self._lock:
            if block_hash in self._index:
                self._index.move_to_end(block_hash)
                return
            victims = []
            while s.bytes_held + len(data) > s.capacity_bytes and self._index:
                old, (_, size) = self._index.popitem(last=False)
                s.bytes_held -= size
                victims.append(old)
        for old in victims:
            try:
                os.unlink(self.path(old))
            except OSError:
                pass
        try:
            self._write(self.path(block_hash), data)
        except OSError as err:
            self._write_failed(err)
            return
        self._touch(self.path(block_hash))
        with self._lock:
            self._index[block_hash] = (key, len(data))
            s.bytes_held += len(data)
            s.blocks = len(self._index)
        s.bytes_written += len(payload)

    @staticmethod
    def _write(path: Path, data: bytes) -> None:
        """temp file, fsync, rename, fsync of the directory."""
        path.parent.mkdir(exist_ok=True)
        tmp = path.with_name(f"{path.name}.tmp{os.getpid()}")
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            try:
                view = memoryview(data)
                while view:
                    view = view[os.write(fd, view):]
                os.fsync(fd)
            finally:
                os.close(fd)
            os.rename(tmp, path)
        except OSError:
            tmp.unlink(missing_ok=True)
            raise
        dir_fd = os.open(path.parent, os.O_RDONLY)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)

    def _write_failed(self, err: OSError) -> None:
        self.stats.write_errors += 1
        if err.errno == errno.ENOSPC:
            self.stats.disabled = True
            log.error("KV disk tier %s turned off: the disk is full (%s); serving goes on "
                      "without it", self.dir, err.strerror)
        else:
            log.warning("KV disk tier: a block write failed (%s)", err)

    def close(self) -> None:
        """Nothing held open (the directory lock belongs to ``TierDir``)."""
