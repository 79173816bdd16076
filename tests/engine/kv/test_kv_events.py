"""KV events (``--kv-events-config``): a subscriber that decodes every batch with vLLM's own
struct definitions (``vllm_event_structs.py``) and replays BlockStored / BlockRemoved ends
with exactly the blocks the pool and the RAM and disk tiers hold, after a run with pool
evictions, preemptions, tier evictions, ``reset_prefix_cache`` and a restart on the disk tier;
each stored block's tokens are a block of a sequence the engine was given or generated."""

from __future__ import annotations

import random
import socket

import msgspec
import pytest
import torch
import zmq
from vllm_event_structs import structs
from zmq.utils.monitor import recv_monitor_message

from kvledger.engine.config import EngineConfig
from kvledger.engine.engine import LLMEngine
from kvledger.engine.kv.events.config import parse_kv_events_config
from kvledger.engine.kv.events.publisher import KVEventPublisher
from kvledger.engine.sample.sampling_params import SamplingParams
from kvledger.errors import InvalidParameterError
from kvledger.model.weights.loader import load_weights

BS = 16
SAMPLING = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
MEDIUM = {"pool": "GPU", "ram": "CPU", "disk": "STORAGE"}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def ext(digest: bytes) -> int:
    """vLLM's int ExternalBlockHash of a sha256 digest (``maybe_convert_block_hash``)."""
    return int.from_bytes(digest, "big") & ((1 << 64) - 1)


class Subscriber:
    """A router's view: the replay socket's batches decoded with vLLM's structs, replayed."""

    def __init__(self, replay_port: int, array_like: bool) -> None:
        self.batch, self.stored, self.removed, self.cleared = structs(array_like)
        self.decoder = msgspec.msgpack.Decoder(self.batch)
        self.replay_port = replay_port
        self.held: set[tuple[str, int, int]] = set()
        self.tokens: dict[tuple[str, int, int], list[int]] = {}
        self.counts = {"stored": 0, "removed": 0, "cleared": 0}

    def fetch(self, start: int = 0) -> list[tuple[int, object]]:
        sock = zmq.Context.instance().socket(zmq.DEALER)
        sock.connect(f"tcp://127.0.0.1:{self.replay_port}")
        sock.send_multipart((b"", start.to_bytes(8, "big")))
        out = []
        while True:
            assert sock.poll(10_000), "the replay socket did not answer"
            _, seq, payload = sock.recv_multipart()
            seq = int.from_bytes(seq, "big", signed=True)
            if seq == -1:
                break
            out.append((seq, self.decoder.decode(payload)))
        sock.close(linger=0)
        return out

    def apply(self, batch) -> None:
        assert batch.data_parallel_rank == 0
        for ev in batch.events:
            if isinstance(ev, self.cleared):
                self.held.clear()
                self.counts["cleared"] += 1
                continue
            if isinstance(ev, self.removed):
                for h in ev.block_hashes:
                    where = (ev.medium, ev.group_idx, h)
                    assert where in self.held, f"removed, never stored: {where}"
                    self.held.remove(where)
                    self.counts["removed"] += 1
                continue
            assert isinstance(ev, self.stored) and ev.block_size == BS
            assert len(ev.token_ids) == BS * len(ev.block_hashes)
            assert ev.extra_keys == [None] * len(ev.block_hashes)
            assert ev.kv_cache_spec_kind == "full_attention"
            for i, h in enumerate(ev.block_hashes):
                where = (ev.medium, ev.group_idx, h)
                assert where not in self.held, f"stored twice: {where}"
                self.held.add(where)
                self.tokens[where] = ev.token_ids[i * BS:(i + 1) * BS]
                self.counts["stored"] += 1


def held_by(engine) -> set[tuple[str, int, int]]:
    """What the engine's pool and tiers hold (read from their insides: the oracle)."""
    out = set()
    for block in engine.scheduler.kv.pool.blocks:
        if block.block_hash is not None:
            group, digest = (block.block_hash if isinstance(block.block_hash, tuple)
                             else (0, block.block_hash))
            out.add(("GPU", group, ext(digest)))
    if engine.tiers is not None:
        engine.tiers.chain.flush()
        for tier in engine.tiers.chain.tiers:
            index = tier._blocks if tier.name == "ram" else tier._index
            out |= {(MEDIUM[tier.name], 0, ext(h)) for h in list(index)}
    return out


@pytest.fixture(scope="module")
def tiny(tiny_llama):
    folder, _ = tiny_llama
    spec, weights = load_weights(folder, torch.float32)
    return folder, spec, weights


def build(tiny, port, replay_port, encoding="map", **options) -> LLMEngine:
    folder, spec, weights = tiny
    events = {"enable_kv_cache_events": True, "endpoint": f"tcp://*:{port}",
              "replay_endpoint": f"tcp://*:{replay_port}", "topic": "kv@pod-a@tiny",
              "encoding": encoding}
    config = EngineConfig(model=str(folder), dtype="fp32", kv_events_config=msgspec.json.encode(
        events).decode(), **options)
    return LLMEngine(config, spec=spec, weights=dict(weights))


def run_all(engine, prompts, prefix="r") -> list[list[int]]:
    for i, prompt in enumerate(prompts):
        engine.add_request(f"{prefix}{i}", prompt, SAMPLING)
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out.prompt_token_ids + out.token_ids
    return list(done.values())


def check(engine, sub: Subscriber, sequences: list[list[int]]) -> None:
    engine.kv_events.flush()
    expected = held_by(engine)
    engine.kv_events.flush()  # the tiers' writes, flushed above, reported their events
    sub.held.clear()
    for _, batch in sub.fetch():
        sub.apply(batch)
    assert sub.held == expected
    blocks = {tuple(seq[i:i + BS]) for seq in sequences for i in range(0, len(seq) - BS + 1, BS)}
    assert all(tuple(t) in blocks for t in sub.tokens.values())


@pytest.mark.parametrize("encoding", ["array", "map"])
def test_a_subscriber_replaying_the_events_holds_what_the_engine_holds(tiny, tmp_path,
                                                                     encoding):
    rng = random.Random(5)
    shared = [rng.randrange(3, 320) for _ in range(40)]
    prompts = [shared + [rng.randrange(3, 320) for _ in range(rng.randrange(10, 40))]
               for _ in range(8)]
    port, replay = free_port(), free_port()
    opts = {"num_blocks": 14, "max_num_seqs": 4, "kv_ram_gib": 0.0001,
            "kv_disk_dir": str(tmp_path / "disk"), "kv_disk_gib": 0.0002}
    engine = build(tiny, port, replay, encoding, **opts)
    sub = Subscriber(replay, encoding == "array")
    sequences = run_all(engine, prompts)
    assert engine.stats()["num_preemptions"] > 0
    check(engine, sub, sequences)
    assert sub.counts["removed"] > 0 and sub.counts["cleared"] == 1
    mediums = {m for m, _, _ in sub.held}
    assert mediums == {"GPU", "CPU", "STORAGE"}

    assert engine.reset_prefix_cache() > 0
    sequences += run_all(engine, prompts[:3], "again")
    check(engine, sub, sequences)

    engine.close()  # a restart: the disk tier's blocks are announced again
    engine = build(tiny, port, replay, encoding, **opts)
    sub = Subscriber(replay, encoding == "array")
    check(engine, sub, sequences)
    assert {m for m, _, _ in sub.held} == {"STORAGE"}
    sequences += run_all(engine, prompts[3:5], "after")
    check(engine, sub, sequences)
    engine.close()


def test_the_live_socket_carries_the_replayed_batches(tiny):
    port, replay = free_port(), free_port()
    ctx = zmq.Context.instance()
    live = ctx.socket(zmq.SUB)
    live.connect(f"tcp://127.0.0.1:{port}")
    live.setsockopt(zmq.SUBSCRIBE, b"kv@pod-a@tiny")
    monitor = live.get_monitor_socket(zmq.EVENT_HANDSHAKE_SUCCEEDED)
    engine = build(tiny, port, replay)
    # a SUB socket misses what is published before it has joined (ZeroMQ's slow joiner)
    assert monitor.poll(30_000), "the subscriber never joined the publisher"
    recv_monitor_message(monitor)
    live.disable_monitor()
    monitor.close(linger=0)
    sub = Subscriber(replay, False)
    sequences = run_all(engine, [[7] * 50, [7] * 40 + [9] * 20])
    engine.kv_events.flush()
    replayed = dict(sub.fetch())
    got = []
    while live.poll(1000):
        topic, seq, payload = live.recv_multipart()
        assert topic == b"kv@pod-a@tiny"
        got.append((int.from_bytes(seq, "big"), sub.decoder.decode(payload)))
    live.close(linger=0)
    assert got and [s for s, _ in got] == sorted(s for s, _ in got)
    assert all(replayed[s] == batch for s, batch in got)
    assert got[-1][0] == max(replayed)
    check(engine, sub, sequences)
    engine.close()


@pytest.mark.parametrize("text, message", [
    ("[]", "JSON object"),
    ('{"enable_kv_cache_events": true, "port": 1}', "unknown key 'port'"),
    ('{"enable_kv_cache_events": "yes"}', "enable_kv_cache_events must be bool"),
    ('{"buffer_steps": 0}', "buffer_steps must be >= 1"),
    ('{"publisher": "kafka"}', "publisher must be one of"),
    ('{"encoding": "json"}', "encoding must be one of"),
    ("{", "not JSON"),
])
def test_a_bad_config_is_refused_by_name(text, message):
    with pytest.raises(InvalidParameterError, match=message):
        parse_kv_events_config(text)


def test_a_disabled_or_null_config_publishes_nothing():
    assert not parse_kv_events_config("{}").publishes
    assert not parse_kv_events_config(
        '{"enable_kv_cache_events": true, "publisher": "null"}').publishes
    assert parse_kv_events_config('{"enable_kv_cache_events": true}').publishes


@pytest.mark.parametrize("replay_topic", [False, True])
def test_replay_answers_carry_the_topic_frame_only_when_asked(replay_topic):
    port, replay = free_port(), free_port()
    config = parse_kv_events_config(msgspec.json.encode({
        "enable_kv_cache_events": True, "endpoint": f"tcp://*:{port}",
        "replay_endpoint": f"tcp://*:{replay}", "topic": "kv@pod-a@tiny",
        "replay_topic": replay_topic}).decode())
    publisher = KVEventPublisher(config, BS, ())  # publishes AllBlocksCleared as batch 0
    publisher.flush()
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.connect(f"tcp://127.0.0.1:{replay}")
    sock.send_multipart((b"", (0).to_bytes(8, "big")))
    answers = []
    for _ in range(2):
        assert sock.poll(10_000), "the replay socket did not answer"
        answers.append(sock.recv_multipart())
    sock.close(linger=0)
    publisher.close()
    batch, end = answers
    end_seq = (-1).to_bytes(8, "big", signed=True)
    if replay_topic:  # vllm-router 0.1.17: [b"", topic, seq, batch], then [b"", b"", -1, b""]
        assert batch[:3] == [b"", b"kv@pod-a@tiny", (0).to_bytes(8, "big")]
        assert end == [b"", b"", end_seq, b""]
    else:  # vLLM's ZmqEventPublisher: [b"", seq, batch], then [b"", -1, b""]
        assert batch[:2] == [b"", (0).to_bytes(8, "big")] and len(batch) == 3
        assert end == [b"", end_seq, b""]
    cleared = structs(False)[0]
    assert msgspec.msgpack.Decoder(cleared).decode(batch[-1]).events[0].__class__.__name__ \
        == "AllBlocksCleared"
