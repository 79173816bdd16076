"""tune_malloc (server/heap_trim.py): the bounds on glibc's heaps that ``kvledger serve`` sets
at start, checked in a fresh interpreter through glibc's own statistics (``mallinfo2``,
``malloc_info``), not through what the function returns."""

from __future__ import annotations

import ctypes.util
import os
import subprocess
import sys
import textwrap

import pytest

GLIBC = ctypes.util.find_library("c") or ""
pytestmark = pytest.mark.skipif(not GLIBC.startswith("libc.so"), reason="needs glibc")

PRELUDE = """
import ctypes, os, sys, threading, tempfile
from kvledger.server.heap_trim import ARENA_MAX, MMAP_THRESHOLD_BYTES, tune_malloc
class MallInfo2(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in ("arena", "ordblks", "smblks", "hblks", "hblkhd",
                "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost")]
libc = ctypes.CDLL("libc.so.6")
libc.mallinfo2.restype = MallInfo2
libc.malloc.restype = ctypes.c_void_p
libc.malloc.argtypes = [ctypes.c_size_t]
libc.free.argtypes = [ctypes.c_void_p]
if sys.argv[1] == "tuned":
    tune_malloc()
"""


def run(body: str, tuned: bool) -> str:
    env = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")}
    code = PRELUDE + textwrap.dedent(body)
    return subprocess.run([sys.executable, "-c", code, "tuned" if tuned else "default"],
                          env=env, capture_output=True, text=True, check=True).stdout


MMAPPED_AFTER_A_LARGER_FREE = """
libc.free(libc.malloc(4 * MMAP_THRESHOLD_BYTES))  # mmapped; the default raises its threshold
before = libc.mallinfo2().hblks
chunk = libc.malloc(2 * MMAP_THRESHOLD_BYTES)
print(libc.mallinfo2().hblks - before)  # 1: this chunk was mmapped (unmapped when freed)
"""


def test_a_large_chunk_stays_mmapped_after_a_larger_one_was_freed():
    # glibc's dynamic threshold (the default, printed 0 before tune_malloc) would put this
    # chunk in a heap, where it leaves a high-water mark once freed
    assert run(MMAPPED_AFTER_A_LARGER_FREE, tuned=False).strip() == "0"  # the old behaviour
    assert run(MMAPPED_AFTER_A_LARGER_FREE, tuned=True).strip() == "1"


ARENAS_OF_SIX_THREADS = """
ready, done = threading.Barrier(7), threading.Event()
def worker():
    keep = libc.malloc(1000)  # a thread's first malloc takes (or makes) an arena
    ready.wait()
    done.wait()
    libc.free(keep)
threads = [threading.Thread(target=worker) for _ in range(6)]
for t in threads:
    t.start()
ready.wait()
path = tempfile.NamedTemporaryFile(delete=False).name
libc.fopen.restype = ctypes.c_void_p
libc.fopen.argtypes = [ctypes.c_char_p, ctypes.c_char_p]
libc.fclose.argtypes = [ctypes.c_void_p]
libc.malloc_info.argtypes = [ctypes.c_int, ctypes.c_void_p]
f = libc.fopen(path.encode(), b"w")
libc.malloc_info(0, f)
libc.fclose(f)
done.set()
print(open(path).read().count("<heap nr="), ARENA_MAX)
os.unlink(path)
"""


def test_six_threads_share_at_most_arena_max_arenas():
    arenas, arena_max = map(int, run(ARENAS_OF_SIX_THREADS, tuned=False).split())
    assert arenas > arena_max  # glibc's default: an arena per thread, up to 8 per core
    arenas, arena_max = map(int, run(ARENAS_OF_SIX_THREADS, tuned=True).split())
    assert arenas <= arena_max


def test_the_environment_wins():
    env = dict(os.environ, MALLOC_ARENA_MAX="4")
    code = "from kvledger.server.heap_trim import tune_malloc; print(sorted(tune_malloc()))"
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         check=True).stdout
    assert out.strip() == "['MALLOC_MMAP_THRESHOLD_']"
