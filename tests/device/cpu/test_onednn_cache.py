"""oneDNN's per-shape caches stay bounded once the CPU device set up (onednn_cache.py): bf16
products over many distinct row counts, measured by glibc's count of live bytes in a fresh
interpreter (the caches read their capacity once, at first use)."""

from __future__ import annotations

import ctypes.util
import os
import subprocess
import sys

import pytest

GLIBC = ctypes.util.find_library("c") or ""
pytestmark = pytest.mark.skipif(not GLIBC.startswith("libc.so"), reason="needs glibc mallinfo2")

CODE = """
import ctypes, sys, torch
from kvledger.device.cpu.device import DEVICE
class MallInfo2(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in ("arena", "ordblks", "smblks", "hblks", "hblkhd",
                "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost")]
libc = ctypes.CDLL("libc.so.6")
libc.mallinfo2.restype = MallInfo2
def live_mib():
    info = libc.mallinfo2()
    return (info.uordblks + info.hblkhd) / (1 << 20)
if sys.argv[1] == "device":
    DEVICE.threads(1)
torch.set_num_threads(1)
w = torch.randn(1024, 1024).to(torch.bfloat16)
x = torch.randn(300, 1024).to(torch.bfloat16)
grown = []
for rows in (range(1, 101), range(101, 201), range(201, 301)):
    before = live_mib()
    for n in rows:  # a batch of n tokens: a shape never seen before
        torch.nn.functional.linear(x[:n], w)
    grown.append(live_mib() - before)
print(*grown)
"""


def grown_mib(setup: str) -> list[float]:
    env = {k: v for k, v in os.environ.items()
           if k not in ("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "LRU_CACHE_CAPACITY")}
    out = subprocess.run([sys.executable, "-c", CODE, setup], env=env, capture_output=True,
                         text=True, check=True).stdout
    return [float(v) for v in out.split()]


def test_products_of_300_row_counts_hold_no_more_than_the_first_100():
    first, second, third = grown_mib("device")
    # at the cap (64 entries) the caches are full within the first 100 shapes: what the
    # next 200 add is evictions' churn, not a cache growing by a shape each (the default,
    # 1,024 entries, grew ~54 MiB per 100 shapes here: ~0.5 MiB an entry)
    assert second < 8 and third < 8, (first, second, third)
