"""Give the heap's free memory back to the operating system, and keep it from piling up.

A non-streamed response with prompt logprobs builds hundreds of thousands of small Python
objects and megabytes of JSON; once they are freed, glibc keeps most of those pages in the
process (the issue 61 figure: RSS +1.7 GB that never went back). ``malloc_trim(0)`` returns
them. It runs in the thread that built the response, after it, only for bodies of at least
:data:`TRIM_FROM_BYTES`, and does nothing where the C library has no ``malloc_trim``
(musl, macOS).

Steps keep freeing memory too: under a mixed load the engine's RSS crept up by ~30 MiB a
minute, no Python object or tensor more (a census), most of it free heap that
``malloc_trim`` gave back (issue 61 item 11). :class:`PeriodicTrim` trims at most every
:data:`TRIM_EVERY_S` seconds, called by the engine thread between steps.

What the trims could not reach: glibc's *dynamic* mmap threshold. Each freed mmapped chunk
raises the threshold to its size (up to 32 MiB), so after the first step every activation,
logits and JSON buffer of a few MiB came from the heaps instead of ``mmap``; batch shapes
vary, so the heaps kept high-water marks and holes, and each thread (the event loop, the
engine, the tokenizer and grammar threads) had its own arena of them. In 6-minute mixed soaks
(issue 61 item 11) the arenas held 116-244 MiB of free chunks (``mallinfo2().fordblks``)
between trims; 17-31 MiB with the settings below (at a 1 MiB threshold; 4 MiB costs fewer
page faults: an engine run of 96 steps took ~20 % longer at 1 MiB, none measurable at 4; the
10-minute soak's second-half RSS growth: 19.5 % before, 0.17 % at 1 MiB, 3.6 % at 4 MiB). :func:`tune_malloc`, called by ``kvledger serve`` before the model
loads, fixes the threshold at :data:`MMAP_THRESHOLD_BYTES` (a chunk that large is unmapped
when freed) and caps the arenas at :data:`ARENA_MAX` (glibc's tunables, ``mallopt``);
``MALLOC_MMAP_THRESHOLD_`` / ``MALLOC_ARENA_MAX`` in the environment win over both.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import os
import time

TRIM_FROM_BYTES = 1 << 20
TRIM_EVERY_S = 30.0
MMAP_THRESHOLD_BYTES = 4 << 20
ARENA_MAX = 2
_M_MMAP_THRESHOLD = -3  # mallopt parameters (malloc.h)
_M_ARENA_MAX = -8


def _malloc_trim():
    return getattr(_libc(), "malloc_trim", None)


@functools.cache
def _libc():
    name = ctypes.util.find_library("c")
    try:
        return ctypes.CDLL(name) if name else None
    except OSError:
        return None


def tune_malloc() -> dict[str, int]:
    """Fix glibc's mmap threshold and cap its arenas (module docstring); the settings made,
    by environment variable name (none where the C library has no ``mallopt``, or where the
    environment already set that variable)."""
    mallopt = getattr(_libc(), "mallopt", None)
    if mallopt is None:
        return {}
    made = {}
    for env, param, value in (("MALLOC_MMAP_THRESHOLD_", _M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES),
                              ("MALLOC_ARENA_MAX", _M_ARENA_MAX, ARENA_MAX)):
        if env not in os.environ and mallopt(param, value) == 1:
            made[env] = value
    return made


def trim_after(body_bytes: int) -> bool:
    """Return the heap's free pages to the OS after a response of ``body_bytes``; True when
    it was done (a large body on a C library that can)."""
    trim = _malloc_trim()
    if body_bytes < TRIM_FROM_BYTES or trim is None:
        return False
    trim(0)
    return True


class PeriodicTrim:
    """``malloc_trim(0)`` at most once every ``every_s`` seconds (None:
    :data:`TRIM_EVERY_S`) of the clock ``now``."""

    def __init__(self, every_s: float | None = None, now=time.monotonic) -> None:
        self.every_s = TRIM_EVERY_S if every_s is None else every_s
        self._now = now
        self._last = now()

    def maybe_trim(self) -> bool:
        """Trim when ``every_s`` have passed since the last; True when it did."""
        trim = _malloc_trim()
        if trim is None or self._now() - self._last < self.every_s:
            return False
        trim(0)
        self._last = self._now()
        return True
