"""The disk tier's directory: created with its parents, checked writable and locked, before
the model loads; and the only ways the tier opens, creates or removes an entry under it.

One server per directory: the first takes an exclusive ``flock`` on ``DIR/lock`` for its
lifetime (the kernel drops it when the process dies, however it dies), and a second one is
refused with the holder's pid. Sharing a directory between live servers would need a shared
index; refusing is the simpler safe choice.

The directory may hold anything a hostile or careless hand put there, so nothing under it is
followed out of it: every entry is opened relative to its folder's descriptor with
``O_NOFOLLOW`` (:func:`open_file`, :func:`open_folder`); a file is used only when ``fstat``
says it is a regular file, opened with ``O_NONBLOCK`` so that a FIFO cannot block; new files
are made with ``O_EXCL``; and only regular files are unlinked (:func:`remove_file`). The lock
must be a regular file with no other hard link, or the start is refused naming it: the pid is
written into it. ``DIR`` itself, the path the user named, may be a symbolic link.
"""

from __future__ import annotations

import errno
import fcntl
import os
import secrets
import stat
from dataclasses import dataclass
from pathlib import Path

from kvledger.errors import InvalidParameterError

LOCK_NAME = "lock"
NOFOLLOW = os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
FOLDER = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
KINDS = ((stat.S_ISLNK, "a symbolic link"), (stat.S_ISDIR, "a folder"),
         (stat.S_ISFIFO, "a FIFO"), (stat.S_ISSOCK, "a socket"), (stat.S_ISREG, "a regular file"))


class EntryKindError(OSError):
    """An entry of the tier directory of another kind than the tier uses there (a symbolic
    link, a FIFO, a device...): never read, written, followed or unlinked."""

    def __init__(self, name: str, what: str, wanted: str = "a regular file") -> None:
        super().__init__(f"{name} is not {wanted} but {what}")
        self.what = what


def kind(mode: int) -> str:
    """What a ``st_mode`` is, in words ("a symbolic link", "a FIFO"...)."""
    return next((what for test, what in KINDS if test(mode)), "a device")


def open_file(name: str, flags: int, dir_fd: int, mode: int = 0o644) -> tuple[int, os.stat_result]:
    """``name`` (relative to ``dir_fd``) opened with ``flags``, never through a symbolic link
    and never blocking, and its ``fstat``.

    Raises:
        EntryKindError: ``name`` is not a regular file (a symbolic link, a FIFO...).
        OSError: it cannot be opened.
    """
    try:
        fd = os.open(name, flags | NOFOLLOW, mode, dir_fd=dir_fd)
    except OSError as err:
        if err.errno == errno.ELOOP:  # O_NOFOLLOW's answer for a final symbolic link
            raise EntryKindError(name, "a symbolic link") from None
        raise
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        os.close(fd)
        raise EntryKindError(name, kind(st.st_mode))
    return fd, st


def open_folder(name: str, dir_fd: int) -> int:
    """A descriptor of the folder ``name`` (relative to ``dir_fd``), never through a symbolic
    link.

    Raises:
        EntryKindError: ``name`` is not a folder.
        OSError: it cannot be opened.
    """
    try:
        return os.open(name, FOLDER, dir_fd=dir_fd)
    except OSError as err:
        if err.errno in (errno.ELOOP, errno.ENOTDIR):
            mode = os.stat(name, dir_fd=dir_fd, follow_symlinks=False).st_mode
            raise EntryKindError(name, kind(mode), "a folder") from None
        raise


def remove_file(name: str, dir_fd: int) -> None:
    """Unlink ``name`` (relative to ``dir_fd``) when it is a regular file; nothing else is
    ever removed. Errors are ignored (the file is gone or stays)."""
    try:
        if stat.S_ISREG(os.stat(name, dir_fd=dir_fd, follow_symlinks=False).st_mode):
            os.unlink(name, dir_fd=dir_fd)
    except OSError:
        pass


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
        InvalidParameterError: it cannot be created or written, its lock is not a regular file
            of its own, or another process holds it.
    """
    root = Path(path).expanduser()
    try:
        root.mkdir(parents=True, exist_ok=True)
        dir_fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError as err:
        raise InvalidParameterError(f"--kv-disk-dir {path}: cannot create or write it "
                                    f"({err.strerror})") from None
    try:
        fd = _lock(path, root, dir_fd)
        try:
            os.ftruncate(fd, 0)
            os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
            _write_check(dir_fd)
        except OSError as err:
            os.close(fd)
            raise InvalidParameterError(f"--kv-disk-dir {path}: cannot write to it "
                                        f"({err.strerror})") from None
    finally:
        os.close(dir_fd)
    return TierDir(root, fd)


def _lock(path: str, root: Path, dir_fd: int) -> int:
    """``DIR/lock`` opened (created if absent) and locked: a descriptor."""
    lock = root / LOCK_NAME
    try:
        fd, st = open_file(LOCK_NAME, os.O_RDWR | os.O_CREAT, dir_fd)
    except EntryKindError as err:
        raise InvalidParameterError(
            f"--kv-disk-dir {path}: {lock} is not a regular file but {err.what}; kvledger "
            "writes its pid there and follows no link: remove it") from None
    except OSError as err:
        raise InvalidParameterError(f"--kv-disk-dir {path}: cannot create or write {lock} "
                                    f"({err.strerror})") from None
    if st.st_nlink != 1:
        os.close(fd)
        raise InvalidParameterError(
            f"--kv-disk-dir {path}: {lock} has other hard links ({st.st_nlink} names); "
            "kvledger writes its pid there, which would change them: remove it")
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "unknown"
        os.close(fd)
        raise InvalidParameterError(
            f"--kv-disk-dir {path} is in use by another kvledger process (pid {holder}); "
            "give each server its own directory") from None
    return fd


def _write_check(dir_fd: int) -> None:
    """Create, write and remove a file of a fresh name in the directory (OSError if not)."""
    name = f".write-check.{os.getpid()}.{secrets.token_hex(8)}"
    fd, _ = open_file(name, os.O_WRONLY | os.O_CREAT | os.O_EXCL, dir_fd)
    try:
        os.write(fd, b"ok")
    finally:
        os.close(fd)
    remove_file(name, dir_fd)
