"""KV cache events in vLLM's wire format, for KV-aware routers (docs/fleet.md).

The pool, and each KV tier, report the blocks that enter and leave them through a
:class:`~kvledger.engine.kv.events.recorder.CacheEvents` hook given at construction
(``recorder.py``: a queue put, nothing more on the engine's path); a publisher thread drains the
queue into batches, encodes them as vLLM does (``wire.py``) and sends them over ZeroMQ with a
replay socket (``publisher.py``), as ``--kv-events-config`` (``config.py``) asks.
"""
