"""The KV tier's block file: one full KV block, its identity and a checksum, verified on load.

Layout (little-endian)::

    magic b"KVLTIER\\0" | u32 format version | u32 header length | header (UTF-8 JSON) | payload

The header holds the engine's fingerprint (``fingerprint.py``: everything that changes the
stored bytes), the block's hash and its hash key (parent hash, token ids, extra keys with the
``cache_salt``: ``engine/kv/prefix.py``), the payload's length and its CRC-32 (zlib). A file
is used only when every field matches what the engine asks for and the hash of the key is the
block's hash (:func:`parse_header`, :func:`check_payload`); anything else is
:class:`BlockFileError`.
"""

from __future__ import annotations

import json
import struct
import zlib
from dataclasses import dataclass

from kvledger.engine.kv.prefix import hash_block_key

MAGIC = b"KVLTIER\0"
FORMAT_VERSION = 1
_PREFIX = struct.Struct("<8sII")
MAX_HEADER_BYTES = 1 << 20


class BlockFileError(ValueError):
    """A block file that must not be used (truncated, corrupt, foreign); the message says
    which check failed."""


@dataclass(frozen=True)
class BlockHeader:
    """What a block file says about its payload."""

    fingerprint: str
    block_hash: bytes
    key: tuple
    payload_bytes: int
    payload_crc32: int
    header_bytes: int  # bytes before the payload

    @property
    def file_bytes(self) -> int:
        return self.header_bytes + self.payload_bytes


def _key_json(key: tuple) -> dict:
    parent, tokens, extra = key
    if not all(isinstance(e, str) for e in extra):
        raise BlockFileError(f"extra keys must be strings to be stored, got {extra!r}")
    return {"parent": None if parent is None else parent.hex(), "tokens": list(tokens),
            "extra": list(extra)}


def encode(fingerprint: str, block_hash: bytes, key: tuple, payload: bytes) -> bytes:
    """The file's bytes: prefix, header and payload."""
    header = {"fingerprint": fingerprint, "hash": block_hash.hex(), "key": _key_json(key),
              "payload_bytes": len(payload), "payload_crc32": zlib.crc32(payload)}
    raw = json.dumps(header, separators=(",", ":")).encode()
    return _PREFIX.pack(MAGIC, FORMAT_VERSION, len(raw)) + raw + payload


def parse_header(data: bytes, fingerprint: str) -> BlockHeader:
    """The header at the start of ``data`` (the first bytes of a file, at least the header).

    Raises:
        BlockFileError: bad magic or version, a truncated or malformed header, another
            fingerprint, or a key whose hash is not the recorded block hash.
    """
    if len(data) < _PREFIX.size:
        raise BlockFileError("truncated before the header")
    magic, version, length = _PREFIX.unpack_from(data)
    if magic != MAGIC:
        raise BlockFileError("not a kvledger KV block file")
    if version != FORMAT_VERSION:
        raise BlockFileError(f"file format version {version}, this kvledger writes "
                             f"{FORMAT_VERSION}")
    if length > MAX_HEADER_BYTES or len(data) < _PREFIX.size + length:
        raise BlockFileError("truncated header")
    try:
        h = json.loads(data[_PREFIX.size:_PREFIX.size + length])
        k = h["key"]
        parent = None if k["parent"] is None else bytes.fromhex(k["parent"])
        key = (parent, tuple(int(t) for t in k["tokens"]), tuple(str(e) for e in k["extra"]))
        header = BlockHeader(str(h["fingerprint"]), bytes.fromhex(h["hash"]), key,
                             int(h["payload_bytes"]), int(h["payload_crc32"]),
                             _PREFIX.size + length)
    except (ValueError, KeyError, TypeError) as err:
        raise BlockFileError(f"malformed header ({err})") from None
    if header.fingerprint != fingerprint:
        raise BlockFileError("written by another model or KV layout (fingerprint differs)")
    if hash_block_key(key) != header.block_hash:
        raise BlockFileError("the header's key does not hash to its block hash")
    return header


def check_payload(data: bytes, header: BlockHeader, payload_bytes: int | tuple[int, ...]
                  ) -> memoryview:
    """The payload of a whole file ``data``, checked against its header and the engine's
    ``payload_bytes`` per block (or the lengths a block's payload may have).

    Raises:
        BlockFileError: a length or checksum that does not match.
    """
    sizes = (payload_bytes,) if isinstance(payload_bytes, int) else payload_bytes
    if header.payload_bytes not in sizes:
        raise BlockFileError(f"payload of {header.payload_bytes} bytes, a block holds "
                             f"{' or '.join(map(str, sizes))}")
    if len(data) != header.file_bytes:
        raise BlockFileError(f"file of {len(data)} bytes, its header says {header.file_bytes}")
    payload = memoryview(data)[header.header_bytes:]
    if zlib.crc32(payload) != header.payload_crc32:
        raise BlockFileError("payload checksum mismatch")
    return payload
