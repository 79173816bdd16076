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

Nothing is followed out of the directory (``tier_dir.py``): the tier's folder is opened once,
without following a link, and held for the tier's life; each file is opened relative to it
with ``O_NOFOLLOW | O_NONBLOCK`` and used only when ``fstat`` says it is a regular file (a FIFO
cannot block a start or a load); a write goes through its sub-folder's descriptor, opened
without following a link, to a temporary file made with ``O_EXCL``; start-up walks only real
sub-folders and skips, with a warning, any entry of another kind; only regular files are
removed.
"""

from __future__ import annotations

import errno
import logging
import os
import threading
import time
from collections import OrderedDict
from pathlib import Path

from kvledger.engine.kv.events.recorder import CacheEvents
from kvledger.engine.kv.tiers import block_file
from kvledger.engine.kv.tiers.block_file import BlockFileError
from kvledger.engine.kv.tiers.tier import TierStats
from kvledger.engine.kv.tiers.tier_dir import (
    EntryKindError,
    kind,
    open_file,
    open_folder,
    remove_file,
)
from kvledger.errors import InvalidParameterError

log = logging.getLogger("kvledger.kv_tier")
HEADER_READ_BYTES = 4096
PAGE_BYTES = 4096


class DiskTier:
    """Block files under ``root`` for one engine fingerprint, at most ``capacity_bytes`` of
    files.

    Every file is opened relative to the descriptor of ``root/<fingerprint[:16]>``, held for
    the tier's life, without following a symbolic link (``tier_dir.open_file``); an entry of
    another kind is skipped with a warning, and only regular files are ever removed.

    Args:
        root: the locked tier directory (``tier_dir.open_tier_dir``).
        fingerprint: the engine's fingerprint (hex).
        capacity_bytes: most bytes of block files kept (headers included).
        payload_bytes: bytes of one block's payload (the ledger's bytes per block), or the
            lengths a block's payload may have (``payload.payload_sizes``).
        events: told each block the tier comes to hold (``stored``: written, or found at
            start-up) or stops holding (``removed``); None = nothing.

    Raises:
        InvalidParameterError: ``root/<fingerprint[:16]>`` is not a folder (a symbolic link).
    """

    name = "disk"

    def __init__(self, root: Path, fingerprint: str, capacity_bytes: int,
                 payload_bytes: int | tuple[int, ...], events: CacheEvents | None = None) -> None:
        self.fingerprint, self.payload_bytes = fingerprint, payload_bytes
        self.events = events
        self.dir = Path(root) / fingerprint[:16]
        self._fd = _open_fingerprint_folder(Path(root), self.dir.name)
        self.stats = TierStats(capacity_bytes=capacity_bytes)
        self._index: OrderedDict[bytes, tuple[tuple, int]] = OrderedDict()  # LRU first
        self._lock = threading.Lock()
        self._clock = 0  # the last mtime set (ns): strictly increasing, so ties never reorder
        self._foreign: set[str] = set()  # entries that are not folders: no block goes there
        self.rebuild_seconds = self.rebuild_index()

    def path(self, block_hash: bytes) -> Path:
        return self.dir / self._name(block_hash)

    @staticmethod
    def _name(block_hash: bytes) -> str:
        """The block's file, relative to the tier's folder."""
        h = block_hash.hex()
        return f"{h[:2]}/{h}.kv"

    def rebuild_index(self) -> float:
        """Read every block file's header into the index (LRU order = mtime order); returns
        the seconds it took."""
        start = time.perf_counter()
        found = []
        for sub in os.scandir(self._fd):
            if not sub.is_dir(follow_symlinks=False):
                self._foreign.add(sub.name)
                if not sub.is_file(follow_symlinks=False):
                    self._skip(sub.name, "a folder", sub)
                continue
            found += self._scan(sub.name)
        found.sort()
        self._clock = found[-1][0] if found else 0
        for _, name in found:
            try:
                fd, _ = open_file(name, os.O_RDONLY, self._fd)
                try:
                    header = block_file.parse_header(os.read(fd, HEADER_READ_BYTES),
                                                     self.fingerprint)
                finally:
                    os.close(fd)
                if name != self._name(header.block_hash):
                    raise BlockFileError("file name is not its block hash")
            except EntryKindError as err:  # swapped since the scan
                log.warning("KV disk tier: %s skipped: %s", name, err)
                continue
            except (OSError, BlockFileError) as err:
                self._drop_file(name, err)
                continue
            self._index[header.block_hash] = (header.key, header.file_bytes)
            self.stats.bytes_held += header.file_bytes
        self.stats.blocks = len(self._index)
        if self.events is not None:
            for block_hash, (key, _) in self._index.items():
                self.events.stored(block_hash, key)
        seconds = time.perf_counter() - start
        log.info("KV disk tier %s: %d blocks, %.1f MiB, index read in %.3f s", self.dir,
                 len(self._index), self.stats.bytes_held / (1 << 20), seconds)
        return seconds

    def _scan(self, sub: str) -> list[tuple[int, str]]:
        """(mtime, name) of the block files in the sub-folder ``sub``; leftover temporary
        files (a write that never finished) are removed."""
        try:
            sub_fd = open_folder(sub, self._fd)
        except OSError as err:  # swapped since the listing
            log.warning("KV disk tier: %s skipped: %s", sub, err)
            self._foreign.add(sub)
            return []
        found = []
        try:
            for entry in os.scandir(sub_fd):
                temp, block = ".tmp" in entry.name, entry.name.endswith(".kv")
                if not entry.is_file(follow_symlinks=False):
                    if temp or block:
                        self._skip(f"{sub}/{entry.name}", "a regular file", entry)
                elif temp:
                    remove_file(entry.name, sub_fd)
                elif block:
                    found.append((entry.stat(follow_symlinks=False).st_mtime_ns,
                                  f"{sub}/{entry.name}"))
        finally:
            os.close(sub_fd)
        return found

    def _skip(self, name: str, wanted: str, entry: os.DirEntry) -> None:
        try:
            what = kind(entry.stat(follow_symlinks=False).st_mode)
        except OSError:
            return  # gone since the listing
        log.warning("KV disk tier %s: %s skipped: not %s but %s (never followed, read or "
                    "removed)", self.dir, name, wanted, what)

    def _drop_file(self, name: str, why: Exception) -> None:
        """Count and log a file not used, and remove it when it is a regular file inside the
        tier's folder."""
        self.stats.corrupt_files += 1
        log.warning("KV disk tier: %s not used: %s", name, why)
        self._remove(name)

    def _remove(self, name: str) -> None:
        """Unlink the block file ``name`` when it is a regular file in a sub-folder of the
        tier's folder (not through a symbolic link)."""
        sub, file = name.split("/")
        try:
            sub_fd = open_folder(sub, self._fd)
        except OSError:
            return
        try:
            remove_file(file, sub_fd)
        finally:
            os.close(sub_fd)

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
            fd, st = open_file(self._name(block_hash), os.O_RDONLY, self._fd)
        except OSError:
            return False
        try:
            os.preadv(fd, [bytearray(PAGE_BYTES)], max(0, st.st_size - PAGE_BYTES),
                      os.RWF_NOWAIT)
            return True
        except (OSError, AttributeError):  # not cached, unsupported, or no RWF_NOWAIT here
            return False
        finally:
            os.close(fd)

    def get(self, block_hash: bytes, key: tuple) -> memoryview | None:
        name = self._name(block_hash)
        try:
            fd, st = open_file(name, os.O_RDONLY, self._fd)
        except FileNotFoundError:
            self._forget(block_hash)
            return None
        except OSError as err:
            self._forget(block_hash)
            self._drop_file(name, err)
            return None
        try:
            data = _read_all(fd, st.st_size)
            header = block_file.parse_header(data, self.fingerprint)
            if header.block_hash != block_hash or header.key != key:
                raise BlockFileError("holds another block")
            block_file.check_payload(data, header, self.payload_bytes)
            self._touch(fd)
        except (OSError, BlockFileError) as err:
            self._forget(block_hash)
            self._drop_file(name, err)
            return None
        finally:
            os.close(fd)
        with self._lock:
            if block_hash in self._index:
                self._index.move_to_end(block_hash)
        self.stats.bytes_read += header.payload_bytes
        return memoryview(data)[header.header_bytes:]

    def _touch(self, fd: int) -> None:
        """Set the open file's mtime to a strictly later time than any set before: the LRU
        order that start-up reads back."""
        with self._lock:
            self._clock = max(time.time_ns(), self._clock + 1)
            stamp = self._clock
        try:
            os.utime(fd, ns=(stamp, stamp))
        except OSError:
            pass

    def _forget(self, block_hash: bytes) -> None:
        with self._lock:
            entry = self._index.pop(block_hash, None)
            if entry is not None:
                self.stats.bytes_held -= entry[1]
                self.stats.blocks = len(self._index)
        if entry is not None and self.events is not None:
            self.events.removed(block_hash)

    def put(self, block_hash: bytes, key: tuple, payload: bytes) -> None:
        s = self.stats
        if s.disabled or block_hash.hex()[:2] in self._foreign:
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
            self._remove(self._name(old))
            if self.events is not None:
                self.events.removed(old)
        try:
            self._write(block_hash, data)
        except OSError as err:
            self._write_failed(err)
            return
        with self._lock:
            self._index[block_hash] = (key, len(data))
            s.bytes_held += len(data)
            s.blocks = len(self._index)
        s.bytes_written += len(payload)
        if self.events is not None:
            self.events.stored(block_hash, key)

    def _write(self, block_hash: bytes, data: bytes) -> None:
        """A new temporary file (``O_EXCL``: a name planted there fails), fsync, touch,
        rename, fsync of the sub-folder; all relative to the sub-folder's descriptor."""
        sub, name = self._name(block_hash).split("/")
        try:
            os.mkdir(sub, dir_fd=self._fd)
        except FileExistsError:
            pass
        sub_fd = open_folder(sub, self._fd)
        try:
            tmp = f"{name}.tmp{os.getpid()}"
            fd, _ = open_file(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, sub_fd)
            try:
                try:
                    view = memoryview(data)
                    while view:
                        view = view[os.write(fd, view):]
                    self._touch(fd)
                    os.fsync(fd)
                finally:
                    os.close(fd)
                os.rename(tmp, name, src_dir_fd=sub_fd, dst_dir_fd=sub_fd)
            except OSError:
                remove_file(tmp, sub_fd)  # ours: made with O_EXCL
                raise
            os.fsync(sub_fd)
        finally:
            os.close(sub_fd)

    def _write_failed(self, err: OSError) -> None:
        self.stats.write_errors += 1
        if err.errno == errno.ENOSPC:
            self.stats.disabled = True
            log.error("KV disk tier %s turned off: the disk is full (%s); serving goes on "
                      "without it", self.dir, err.strerror)
        else:
            log.warning("KV disk tier: a block write failed (%s)", err)

    def close(self) -> None:
        """Close the tier's folder (the directory lock belongs to ``TierDir``)."""
        fd, self._fd = self._fd, -1
        if fd >= 0:
            os.close(fd)


def _open_fingerprint_folder(root: Path, name: str) -> int:
    """A descriptor of ``root/name``, made if absent (``root`` too), never through a
    symbolic link.

    Raises:
        InvalidParameterError: ``root/name`` is there and not a folder.
    """
    root.mkdir(parents=True, exist_ok=True)
    root_fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        try:
            os.mkdir(name, dir_fd=root_fd)
        except FileExistsError:
            pass
        return open_folder(name, root_fd)
    except EntryKindError as err:
        raise InvalidParameterError(
            f"KV disk tier: {root / name} is not a folder but {err.what}; the tier follows "
            "no link out of its directory: remove it") from None
    finally:
        os.close(root_fd)


def _read_all(fd: int, size: int) -> bytearray:
    """The first ``size`` bytes of the open file ``fd`` (fewer if it ends before)."""
    data = bytearray(size)
    got = 0
    with memoryview(data) as view:
        while got < size:
            n = os.readv(fd, [view[got:]])
            if n == 0:
                break
            got += n
    del data[got:]
    return data
