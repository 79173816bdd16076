"""The ZeroMQ publisher of KV event batches, on its own thread (vLLM's ``ZmqEventPublisher``
wire protocol, our code).

Each batch goes out on the PUB socket as three frames: the topic, the batch's sequence number
(8 bytes, big-endian, from 0) and the encoded batch (``wire.py``); the last ``buffer_steps``
batches are kept. The ROUTER socket (``replay_endpoint``) answers a request
``[identity, b"", start_seq]`` with ``[identity, b"", seq, batch]`` for every kept batch from
``start_seq`` on, then ``[identity, b"", -1, b""]`` (with ``replay_topic``, the topic comes
before each sequence number, an empty frame before the -1). The thread waits on the hooks' queue,
takes what else is already there (one batch per wake-up, so a step's reports usually travel
together), and answers replay requests between batches.
"""

from __future__ import annotations

import logging
import threading
from collections import deque

import zmq

from kvledger.engine.kv.events.config import KVEventsConfig
from kvledger.engine.kv.events.recorder import MEDIUMS, CacheEvents, EventQueue, to_events
from kvledger.engine.kv.events.wire import BatchEncoder
from kvledger.errors import InvalidParameterError
from kvledger.ledger.kv_groups import KVGroup

log = logging.getLogger("kvledger.kv_events")
END_SEQ = (-1).to_bytes(8, "big", signed=True)
MAX_BATCH = 4096  # reports in one batch at most
POLL_S = 0.05
STOP = ("stop",)  # put last by close(): the thread publishes what is before it and ends


def binds(endpoint: str) -> bool:
    """vLLM's rule: bind a wildcard, ``::``, ``ipc://`` or ``inproc://`` endpoint, else
    connect."""
    return ("*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://")))


class KVEventPublisher:
    """The hooks' queue, the sockets and the thread that joins them.

    Args:
        config: the ``--kv-events-config`` settings (publishing).
        block_size: tokens per block.
        groups: the model's layer groups (``group_idx`` and its spec kind).

    Raises:
        InvalidParameterError: an endpoint ZeroMQ cannot bind or connect (in use, malformed).
    """

    def __init__(self, config: KVEventsConfig, block_size: int,
                 groups: tuple[KVGroup, ...]) -> None:
        self.config, self.block_size, self.groups = config, block_size, groups
        self.queue = EventQueue(config.max_queue_size)
        self.buffer: deque[tuple[int, bytes]] = deque(maxlen=config.buffer_steps)
        self.next_seq = 0
        self._ctx = zmq.Context.instance()
        self._pub = self._socket(zmq.PUB, config.endpoint, binds(config.endpoint))
        self._replay = (self._socket(zmq.ROUTER, config.replay_endpoint, True)
                        if config.replay_endpoint else None)
        self._topic = config.topic.encode()
        self._encoder = BatchEncoder()
        self._thread = threading.Thread(target=self._run, name="kv-event-publisher",
                                        daemon=True)
        self._thread.start()
        self.hook("pool").cleared()  # a restarted replica: the router forgets what it held
        log.info("KV events: publishing on %s%s (topic %r, %s events)", config.endpoint,
                 f", replay on {config.replay_endpoint}" if self._replay else "", config.topic,
                 config.encoding)

    def _socket(self, kind: int, endpoint: str, bind: bool):
        sock = self._ctx.socket(kind)
        if kind == zmq.PUB:
            sock.set_hwm(self.config.hwm)
        try:
            sock.bind(endpoint) if bind else sock.connect(endpoint)
        except zmq.ZMQError as err:
            sock.close(linger=0)
            raise InvalidParameterError(
                f"--kv-events-config: cannot {'bind' if bind else 'connect'} {endpoint}: "
                f"{err}") from None
        return sock

    def hook(self, tier: str) -> CacheEvents:
        """The hook of ``tier`` (``pool``, ``ram``, ``disk``) for its constructor."""
        return CacheEvents(self.queue, MEDIUMS[tier])

    def _run(self) -> None:
        while True:
            if self._replay is not None and self._replay.poll(0):
                self._serve_replay()
            first = self.queue.get(POLL_S)
            if first is None:
                continue
            items = [first, *self.queue.drain(MAX_BATCH - 1)]
            stop = STOP in items
            items = [item for item in items if item is not STOP]
            if items:
                self._send(items)
            self.queue.done(len(items) + stop)
            if stop:
                return

    def _send(self, items: list) -> None:
        try:
            events = to_events(items, self.block_size, self.groups,
                               self.config.encoding == "array")
            payload = self._encoder.encode(items[0][0], events)
            seq = self.next_seq
            self._pub.send_multipart((self._topic, seq.to_bytes(8, "big"), payload))
            self.buffer.append((seq, payload))
            self.next_seq += 1
        except Exception:  # a publishing bug must not stop the thread: log it, go on
            log.exception("KV events: a batch could not be published")

    def _serve_replay(self) -> None:
        frames = self._replay.recv_multipart()
        if len(frames) != 3:
            log.warning("KV events: replay request of %d frames ignored", len(frames))
            return
        client, _, start = frames
        first = int.from_bytes(start, "big")
        head, end = (((client, b"", self._topic), (client, b"", b""))
                     if self.config.replay_topic else ((client, b""), (client, b"")))
        for seq, payload in list(self.buffer):
            if seq >= first:
                self._replay.send_multipart((*head, seq.to_bytes(8, "big"), payload))
        self._replay.send_multipart((*end, END_SEQ, b""))

    def flush(self) -> None:
        """Wait until every report made so far is published (tests, benchmarks)."""
        self.queue.join()

    def close(self) -> None:
        """Publish what is queued, stop the thread, close the sockets."""
        if self._thread.is_alive():
            self.queue.put(STOP)
            self._thread.join(timeout=5)
        self._pub.close(linger=0)
        if self._replay is not None:
            self._replay.close(linger=0)
