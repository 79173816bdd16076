"""``--kv-events-config``: vLLM's ``KVEventsConfig`` keys, read from JSON and checked.

Keys (vLLM ``vllm/config/kv_events.py``): ``enable_kv_cache_events`` (False: nothing is
published), ``publisher`` (``"zmq"``, or ``"null"``; default ``"zmq"`` when enabled),
``endpoint`` (PUB socket, default ``tcp://*:5557``: bound when it holds ``*``, ``::``, or is
``ipc://`` / ``inproc://``, else connected), ``replay_endpoint`` (ROUTER socket answering replay
requests; None: no replay), ``buffer_steps`` (batches kept for replay), ``hwm`` (PUB high-water
mark), ``max_queue_size`` (events waiting for the publisher thread), ``topic``. One key of ours:
``encoding``, ``"map"`` (default: each event a tagged map keyed by field name, as vLLM sends
since its PR #42892, and the only layout vllm-router 0.1.17 reads) or ``"array"`` (each event a
tagged positional array, what vLLM sent before, for consumers that predate the change); and
``replay_topic`` (False: replay answers are vLLM's ``[seq, batch]``; True: ``[topic, seq,
batch]`` and ``[b"", -1, b""]`` at the end, the framing vllm-router 0.1.17 reads, as
TensorRT-LLM's publisher sends it). An unknown key or a wrong type is refused by name.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, fields

from kvledger.errors import InvalidParameterError

ENCODINGS = ("array", "map")
PUBLISHERS = ("zmq", "null")


@dataclass(frozen=True)
class KVEventsConfig:
    """vLLM's KV event publisher settings (module docstring)."""

    enable_kv_cache_events: bool = False
    publisher: str | None = None
    endpoint: str = "tcp://*:5557"
    replay_endpoint: str | None = None
    buffer_steps: int = 10_000
    hwm: int = 100_000
    max_queue_size: int = 100_000
    topic: str = ""
    encoding: str = "map"
    replay_topic: bool = False

    @property
    def publishes(self) -> bool:
        """True when events are sent (enabled, publisher not ``null``)."""
        return self.enable_kv_cache_events and (self.publisher or "zmq") == "zmq"


TYPES = {"enable_kv_cache_events": bool, "publisher": str, "endpoint": str,
         "replay_endpoint": str, "buffer_steps": int, "hwm": int, "max_queue_size": int,
         "topic": str, "encoding": str, "replay_topic": bool}


def parse_kv_events_config(text: str) -> KVEventsConfig:
    """The config of a ``--kv-events-config`` JSON object.

    Raises:
        InvalidParameterError: not a JSON object, an unknown key, a value of the wrong type, an
            unknown publisher or encoding, a count below 1.
    """
    try:
        raw = json.loads(text)
    except json.JSONDecodeError as err:
        raise InvalidParameterError(f"--kv-events-config is not JSON: {err}") from None
    if not isinstance(raw, dict):
        raise InvalidParameterError("--kv-events-config must be a JSON object")
    known = {f.name for f in fields(KVEventsConfig)}
    for key, value in raw.items():
        if key not in known:
            raise InvalidParameterError(
                f"--kv-events-config: unknown key {key!r} (known: {', '.join(sorted(known))})")
        want = TYPES[key]
        nullable = key in ("publisher", "replay_endpoint")
        ok = (value is None and nullable) or (
            isinstance(value, want) and not (want is int and isinstance(value, bool)))
        if not ok:
            raise InvalidParameterError(f"--kv-events-config: {key} must be {want.__name__}, "
                                        f"got {value!r}")
        if want is int and value < 1:
            raise InvalidParameterError(f"--kv-events-config: {key} must be >= 1, got {value}")
    config = KVEventsConfig(**raw)
    if config.publisher not in (None, *PUBLISHERS):
        raise InvalidParameterError(f"--kv-events-config: publisher must be one of "
                                    f"{', '.join(PUBLISHERS)}, got {config.publisher!r}")
    if config.encoding not in ENCODINGS:
        raise InvalidParameterError(f"--kv-events-config: encoding must be one of "
                                    f"{', '.join(ENCODINGS)}, got {config.encoding!r}")
    return config
