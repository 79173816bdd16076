"""Give the heap's free memory back to the operating system after a large response.

A non-streamed response with prompt logprobs builds hundreds of thousands of small Python
objects and megabytes of JSON; once they are freed, glibc keeps most of those pages in the
process (the issue 61 figure: RSS +1.7 GB that never went back). ``malloc_trim(0)`` returns
them. It runs in the thread that built the response, after it, only for bodies of at least
:data:`TRIM_FROM_BYTES`, and does nothing where the C library has no ``malloc_trim``
(musl, macOS).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools

TRIM_FROM_BYTES = 1 << 20


@functools.cache
def _malloc_trim():
    name = ctypes.util.find_library("c")
    try:
        return ctypes.CDLL(name).malloc_trim if name else None
    except (OSError, AttributeError):
        return None


def trim_after(body_bytes: int) -> bool:
    """Return the heap's free pages to the OS after a response of ``body_bytes``; True when
    it was done (a large body on a C library that can)."""
    trim = _malloc_trim()
    if body_bytes < TRIM_FROM_BYTES or trim is None:
        return False
    trim(0)
    return True
