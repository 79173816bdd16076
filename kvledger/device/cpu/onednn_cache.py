"""Caps on the two caches of oneDNN that torch's CPU matmuls fill, one entry per shape.

A bf16 ``F.linear`` goes through oneDNN (ideep): each new (weight shape, row count) builds a
primitive, kept in oneDNN's primitive cache and in ideep's LRU of computations, 1,024 entries
each by default. A server's row counts vary with every batch, so both fill up: on the bundled
model's four linear shapes, 232 row counts held +536 MiB (0.58 MiB an entry), the live native
memory that grew under the issue 61 item 11 soak. At :data:`ENTRIES` each the same run held
+74 MiB at 128 and +19 MiB at 32, in the same time (a miss rebuilds a primitive in well under
a millisecond against a step of many).

Both caches read their capacity from the environment the first time they are used (oneDNN's
``ONEDNN_PRIMITIVE_CACHE_CAPACITY``, ideep's ``LRU_CACHE_CAPACITY``), so :func:`cap_caches`
runs before the engine's first product; a capacity the environment already set wins.
"""

from __future__ import annotations

import os

ENTRIES = 64
VARIABLES = ("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "LRU_CACHE_CAPACITY")


def cap_caches() -> dict[str, str]:
    """Set each cache's capacity to :data:`ENTRIES` unless the environment set it; the
    variables as they now are."""
    return {name: os.environ.setdefault(name, str(ENTRIES)) for name in VARIABLES}
