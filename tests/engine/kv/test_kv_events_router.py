"""vllm-router's ``kv_aware`` policy, its own scoring (the router's binary), steered by our
engines' KV events: a request whose prefix one engine's pool holds goes to that engine's
worker, whether the router learnt it from the replay socket (stored before it started) or from
the live one, and a prefix the engine dropped (``reset_prefix_cache``) no longer draws requests.

Each engine is a real :class:`LLMEngine` publishing as ``bench_fleet.py``'s replicas do (empty
topic, map layout, ``replay_topic``: without it the router's replay fails and it forgets what
was stored before it started); its worker is a stand-in HTTP server that answers the router's ``/tokenize`` (the
prompt text is the token ids, space-separated) and records the completions it is sent. The
router comes from ``KVLEDGER_VLLM_ROUTER`` or ``vllm-router`` on the PATH (``pip install
vllm-router``); without it the test skips."""

from __future__ import annotations

import json
import os
import random
import shutil
import socket
import subprocess
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx
import msgspec
import pytest
import torch

from kvledger.engine.config import EngineConfig
from kvledger.engine.engine import LLMEngine
from kvledger.engine.sample.sampling_params import SamplingParams
from kvledger.model.weights.loader import load_weights

ROUTER = os.environ.get("KVLEDGER_VLLM_ROUTER") or shutil.which("vllm-router")
pytestmark = pytest.mark.skipif(not ROUTER or not os.path.exists(ROUTER),
                                reason="vllm-router not found (KVLEDGER_VLLM_ROUTER)")
MODEL = "tiny"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Worker:
    """The HTTP side of a replica, as the router sees it; ``prompts`` it was sent."""

    def __init__(self) -> None:
        self.prompts: list[str] = []
        worker = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args) -> None:
                pass

            def _reply(self, code: int, body: dict) -> None:
                data = json.dumps(body).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self) -> None:
                if self.path == "/v1/models":
                    self._reply(200, {"object": "list", "data": [{"id": MODEL,
                                                                  "object": "model"}]})
                else:
                    self._reply(200 if self.path == "/health" else 404, {})

            def do_POST(self) -> None:
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                if self.path == "/tokenize":
                    ids = [int(t) for t in body["prompt"].split()]
                    self._reply(200, {"tokens": ids, "count": len(ids), "max_model_len": 4096})
                elif self.path == "/v1/completions":
                    worker.prompts.append(body["prompt"])
                    self._reply(200, {"id": "c", "object": "text_completion", "created": 0,
                                      "model": MODEL, "choices": [{
                                          "index": 0, "text": "x", "logprobs": None,
                                          "finish_reason": "length"}],
                                      "usage": {"prompt_tokens": 1, "completion_tokens": 1,
                                                "total_tokens": 2}})
                else:
                    self._reply(404, {})

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()


def engine_with_events(tiny_llama) -> tuple[LLMEngine, int, int]:
    folder, _ = tiny_llama
    spec, weights = load_weights(folder, torch.float32)
    port, replay = free_port(), free_port()
    events = {"enable_kv_cache_events": True, "endpoint": f"tcp://*:{port}",
              "replay_endpoint": f"tcp://*:{replay}", "topic": "", "replay_topic": True}
    config = EngineConfig(model=str(folder), dtype="fp32", num_blocks=64,
                          kv_events_config=msgspec.json.encode(events).decode())
    return LLMEngine(config, spec=spec, weights=dict(weights)), port, replay


def serve(engine: LLMEngine, prompt: list[int]) -> None:
    engine.add_request(f"r{time.monotonic_ns()}", prompt,
                       SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True))
    while engine.has_unfinished_requests():
        engine.step()
    engine.kv_events.flush()


def routed(router: str, workers: list[Worker], prompt: list[int]) -> int:
    """The index of the worker the router sent ``prompt`` (as text) to."""
    before = [len(w.prompts) for w in workers]
    body = {"model": MODEL, "prompt": " ".join(map(str, prompt)), "max_tokens": 1}
    httpx.post(router + "/v1/completions", json=body, timeout=30).raise_for_status()
    sent = [i for i, w in enumerate(workers) if len(w.prompts) > before[i]]
    assert len(sent) == 1
    return sent[0]


def test_the_routers_kv_aware_scoring_sends_a_prefix_to_the_engine_that_holds_it(tiny_llama,
                                                                                tmp_path):
    rng = random.Random(3)
    p, q = ([rng.randrange(3, 320) for _ in range(64)] for _ in range(2))  # 4 blocks each

    def asked(prefix: list[int]) -> list[int]:
        return prefix + [rng.randrange(3, 320) for _ in range(20)]

    engines = [engine_with_events(tiny_llama) for _ in range(2)]
    workers = [Worker() for _ in engines]
    serve(engines[1][0], asked(p))  # before the router starts: it learns it by replay
    port = free_port()
    cmd = [ROUTER, "--host", "127.0.0.1", "--port", str(port), "--policy", "kv_aware",
           "--prometheus-port", str(free_port()), "--worker-urls", *[w.url for w in workers],
           "--kv-event-block-size", "16", "--kv-event-model", MODEL,
           "--log-level", os.environ.get("KVLEDGER_ROUTER_LOG", "warning")]
    for w, (_, events, replay) in zip(workers, engines):
        cmd += ["--kv-event-source", f"{w.url}=tcp://127.0.0.1:{events}",
                "--kv-event-replay-source", f"{w.url}=tcp://127.0.0.1:{replay}"]
    log = (tmp_path / "router.log").open("w")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    router = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            assert proc.poll() is None and time.monotonic() < deadline, "router did not start"
            try:
                if httpx.get(router + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.3)

        def eventually(prefix: list[int], want: int) -> None:
            """The router picks ``want`` for ``prefix`` once the events have reached it."""
            for _ in range(40):
                if routed(router, workers, asked(prefix)) == want:
                    return
                time.sleep(0.25)
            pytest.fail(f"never routed to worker {want}; see {log.name}")

        # the router replays what it missed once a live batch shows the gap (a short prompt:
        # no full block of p); with nothing credited, idle workers tie and it takes worker 0
        serve(engines[1][0], q[:20])
        eventually(p, 1)
        # every later request of p stays there: it is credited the prefix every time
        assert [routed(router, workers, asked(p)) for _ in range(4)] == [1] * 4
        serve(engines[1][0], asked(q))  # after the router started: the live socket
        eventually(q, 1)
        assert [routed(router, workers, asked(q)) for _ in range(4)] == [1] * 4
        # engine 1 drops both (BlockRemoved): nothing is credited, the tie goes to worker 0
        assert engines[1][0].reset_prefix_cache() > 0
        engines[1][0].kv_events.flush()
        eventually(p, 0)
        assert [routed(router, workers, asked(x)) for x in (p, q, p, q)] == [0] * 4
    finally:
        proc.terminate()
        proc.wait(20)
        for engine, _, _ in engines:
            engine.close()
        for w in workers:
            w.server.shutdown()
