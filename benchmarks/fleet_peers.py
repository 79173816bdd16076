"""The processes of ``bench_fleet.py``: kvledger replicas (``kvledger serve``, one thread each,
KV events on) and the routers in front of them, each router from its own virtual environment.

Routers are found through environment variables, else the documented paths (docs/fleet.md):
``KVLEDGER_VLLM_ROUTER`` (default ``/work/venvs/vllm-router/bin/vllm-router``, from
``pip install vllm-router``) and ``KVLEDGER_SGLANG_ROUTER_PYTHON`` (default
``/work/venvs/sglang-router/bin/python``, from ``pip install sglang-router``). A router not
found is skipped with a line saying so.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

VLLM_ROUTER = os.environ.get("KVLEDGER_VLLM_ROUTER", "/work/venvs/vllm-router/bin/vllm-router")
SGLANG_PYTHON = os.environ.get("KVLEDGER_SGLANG_ROUTER_PYTHON",
                               "/work/venvs/sglang-router/bin/python")
MODEL = "default"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Process:
    """A child process, its log and the URL it serves."""

    name: str
    url: str
    proc: subprocess.Popen
    log: Path
    extra: dict = field(default_factory=dict)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def _start(name: str, cmd: list[str], url: str, logdir: Path, env: dict | None = None,
           **extra) -> Process:
    log = logdir / f"{name}.log"
    proc = subprocess.Popen(cmd, stdout=log.open("w"), stderr=subprocess.STDOUT,
                            env={**os.environ, **(env or {})})
    return Process(name, url, proc, log, extra)


def wait_ready(p: Process, path: str, timeout_s: float = 600) -> None:
    """Poll ``path`` until HTTP 200; raises if the process exits or the time runs out."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if p.proc.poll() is not None:
            raise RuntimeError(f"{p.name} exited ({p.proc.returncode}); see {p.log}")
        try:
            if httpx.get(p.url + path, timeout=5).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(1)
    raise RuntimeError(f"{p.name} not ready after {timeout_s} s; see {p.log}")


def start_replica(i: int, logdir: Path, num_blocks: int, max_num_seqs: int,
                  encoding: str = "map") -> Process:
    """``kvledger serve`` on one thread with KV events on a PUB port and a replay port, on the
    empty topic (vllm-router's static event sources take only that, vLLM's default), replay
    answers with the topic frame vllm-router reads (``replay_topic``)."""
    port, events, replay = free_port(), free_port(), free_port()
    config = {"enable_kv_cache_events": True, "endpoint": f"tcp://*:{events}",
              "replay_endpoint": f"tcp://*:{replay}", "topic": "", "encoding": encoding,
              "replay_topic": True}
    cmd = [sys.executable, "-m", "kvledger", "serve", "--model", MODEL, "--host", "127.0.0.1",
           "--port", str(port), "--threads", "1", "--num-blocks", str(num_blocks),
           "--max-num-seqs", str(max_num_seqs), "--kv-events-config", json.dumps(config)]
    return _start(f"replica-{i}", cmd, f"http://127.0.0.1:{port}", logdir,
                  {"OMP_NUM_THREADS": "1"}, events=f"tcp://127.0.0.1:{events}",
                  replay=f"tcp://127.0.0.1:{replay}")


def router_commands(replicas: list[Process], port: int, block_size: int,
                    model: str) -> dict[str, list[str]]:
    """Name -> command of every router found (module docstring), for the served ``model``."""
    urls = [r.url for r in replicas]
    out = {}
    if Path(VLLM_ROUTER).exists():
        base = [VLLM_ROUTER, "--host", "127.0.0.1", "--port", str(port), "--worker-urls",
                *urls, "--log-level", os.environ.get("KVLEDGER_ROUTER_LOG", "warning"),
                "--prometheus-port", str(free_port())]
        out["vllm-router round_robin"] = [*base, "--policy", "round_robin"]
        out["vllm-router cache_aware"] = [*base, "--policy", "cache_aware"]
        kv = [*base, "--policy", "kv_aware", "--kv-event-block-size", str(block_size),
              "--kv-event-model", os.environ.get("KVLEDGER_KV_EVENT_MODEL", model)]
        for r in replicas:
            kv += ["--kv-event-source", f"{r.url}={r.extra['events']}",
                   "--kv-event-replay-source", f"{r.url}={r.extra['replay']}"]
        out["vllm-router kv_aware"] = kv
        # the tenant (x-session-id) bound to the replica kv_aware first chose, for 10 minutes
        out["vllm-router kv_aware + tenant affinity"] = [
            *kv, "--kv-aware-session-affinity-ttl-secs", "600"]
    else:
        print(f"vllm-router not found at {VLLM_ROUTER} (KVLEDGER_VLLM_ROUTER): skipped")
    if Path(SGLANG_PYTHON).exists():
        out["sglang-router cache_aware"] = [
            SGLANG_PYTHON, "-m", "sglang_router.launch_router", "--host", "127.0.0.1",
            "--port", str(port), "--worker-urls", *urls, "--policy", "cache_aware",
            "--prometheus-port", str(free_port())]
    else:
        print(f"sglang-router not found at {SGLANG_PYTHON} (KVLEDGER_SGLANG_ROUTER_PYTHON): "
              "skipped")
    return out


def start_router(name: str, cmd: list[str], port: int, logdir: Path) -> Process:
    p = _start(name.replace(" ", "-"), cmd, f"http://127.0.0.1:{port}", logdir)
    wait_ready(p, "/health", 120)
    return p
