"""The disk tier's directory: created with its parents, checked writable and locked, before
the model loads.

One server per directory: the first takes an exclusive ``flock`` on ``DIR/lock`` for its
lifetime (the kernel drops it when the process dies, however it dies), and a second one is
refused with the holder's pid. Sharing a directory between live servers would need a shared
index; refusing is the simpler safe choice.
"""

from __future__ import annotations

import fcntl
import os
from dataclasses import dataclass
from pathlib import Path

from kvledger.errors import InvalidParameterError

LOCK_NAME = "lock"


@dataclass
class TierDir:
    """A locked tier directory; ``close`` releases the lock."""

    path: Path
    lock_fd: int

    def close(self) -> None:
        if self.lock_fd >= 0:
            os.close(self.lock_fd)
            self.lock_fd = -1


def open_tier_dir(path: str) -> TierDir:
    """Create ``path`` (parents too), check it takes a file, and lock it for this process.

    Raises:
        InvalidParameterError: it cannot be created or written, or another process holds it.
    """
    root = Path(path).expanduser()
    try:
        root.mkdir(parents=True, exist_ok=True)
        fd = os.open(root / LOCK_NAME, os.O_RDWR | os.O_CREAT, 0o644)
    except OSError as err:
        raise InvalidParameterError(f"--kv-disk-dir {path}: cannot create or write it "
                                    f"({err.strerror})") from None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "unknown"
        os.close(fd)
        raise InvalidParameterError(
            f"--kv-disk-dir {path} is in use by another kvledger process (pid {holder}); "
            "give each server its own directory") from None
    try:
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        probe = root / f".write-check.{os.getpid()}"
        probe.write_bytes(b"ok")
        probe.unlink()
    except OSError as err:
        os.close(fd)
        raise InvalidParameterError(f"--kv-disk-dir {path}: cannot write to it "
                                    f"({err.strerror})") from None
    return TierDir(root, fd)
