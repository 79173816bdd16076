"""ITL and throughput of a server alone and with one core taken by a busy process (issue 44).

    flock /tmp/kvledger-timing.lock /work/bench/quiet.sh \\
        python benchmarks/bench_contention.py [--tokens 128] [--repeats 3] [--streams 8]

For each target, it measures once with the machine otherwise idle ("alone"), then again with
one busy process (a Python spin loop) pinned to one core ("busy"):

- batch 1: ``--repeats`` streamed chat answers of ``--tokens`` tokens one after another. The
  ITL is the median gap between content chunks of each answer, and the figure is the median
  over the answers;
- batch 8: ``--streams`` such answers at once. The figure is the output tokens of all answers
  over the wall time (tok/s), with the median ITL over every gap.

The targets are ``kvledger serve`` at its default threads (a team that shrinks while other
processes take its CPUs, ``device/cpu/thread_team.py``), ``kvledger serve --threads N`` at the
same count (a fixed team, as before that change), and ``llama-server`` on the same GGUF with as
many threads as kvledger's default and ``--streams`` slots. llama-server runs when ``$KVLEDGER_LLAMA_CPP_DIR`` names a folder
holding the binary (benchmarks/peer_llamacpp.py); otherwise that line says why it was skipped.
The issue's targets: busy / alone batch-1 ITL at most 3x, batch-8 throughput at least 0.4x.
Timing: run it alone on the machine, and record the CPU line it prints.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path

import httpx
import peer_llamacpp
from common import machine_line

from kvledger.bench.client import stream_request
from kvledger.device.cpu.cpu_quota import cpu_budget
from kvledger.paths import bundled_model_path

ROOT = Path(__file__).resolve().parents[1]
QUESTION = "Tell me a long story about a lighthouse keeper and a storm."
MAX_ITL_RATIO, MIN_THROUGHPUT_RATIO = 3.0, 0.4  # issue 44's contention targets


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def kvledger_server(threads: int | None, log: Path):
    """``kvledger serve`` (this checkout) on a free port with a scratch state DB; its URL."""
    port = _free_port()
    with tempfile.TemporaryDirectory() as scratch:
        cmd = [sys.executable, "-m", "kvledger.cli", "serve", "--port", str(port),
               "--state-db", str(Path(scratch) / "state.sqlite3")]
        cmd += [] if threads is None else ["--threads", str(threads)]
        with log.open("w") as out:
            proc = subprocess.Popen(cmd, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT)
        try:
            peer_llamacpp.wait_healthy(f"http://127.0.0.1:{port}", proc)
            yield f"http://127.0.0.1:{port}"
        finally:
            peer_llamacpp.stop(proc)


@contextmanager
def llama_server(threads: int, streams: int, log: Path):
    """llama-server on the bundled GGUF with ``streams`` slots; its URL."""
    with peer_llamacpp.Server(bundled_model_path(), _free_port(), threads, parallel=streams,
                              context=4096 * streams, log=log) as server:
        yield server.url


@contextmanager
def busy_core(core: int):
    """A spinning Python process pinned to ``core`` while the block runs (stopped by pid)."""
    spin = f"import os\nos.sched_setaffinity(0, {{{core}}})\nwhile True:\n    pass"
    proc = subprocess.Popen([sys.executable, "-c", spin])
    time.sleep(0.5)  # let it reach its core
    try:
        yield
    finally:
        peer_llamacpp.stop(proc)


def _payload(tokens: int) -> dict:
    return {"messages": [{"role": "user", "content": QUESTION}], "max_tokens": tokens,
            "temperature": 0, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}


async def _answers(url: str, tokens: int, concurrent: int) -> tuple[list, float]:
    async with httpx.AsyncClient(timeout=600) as client:
        start = time.perf_counter()
        results = await asyncio.gather(*(stream_request(
            client, url + "/v1/chat/completions", _payload(tokens)) for _ in range(concurrent)))
        wall = time.perf_counter() - start
    failed = [r.error for r in results if not r.ok]
    if failed:
        raise RuntimeError(f"{len(failed)} requests failed: {failed[0]}")
    return results, wall


def measure(url: str, tokens: int, repeats: int, streams: int) -> dict:
    """Batch-1 median ITL (ms) and batch-``streams`` throughput (tok/s) and ITL (ms)."""
    asyncio.run(_answers(url, 8, 1))  # warm-up
    itl = []
    for _ in range(repeats):
        (answer,), _ = asyncio.run(_answers(url, tokens, 1))
        itl.append(statistics.median(answer.itl_s))
    answers, wall = asyncio.run(_answers(url, tokens, streams))
    gaps = [gap for answer in answers for gap in answer.itl_s]
    return {"itl_b1_ms": 1e3 * statistics.median(itl),
            "throughput_tok_s": sum(a.output_tokens or 0 for a in answers) / wall,
            f"itl_b{streams}_ms": 1e3 * statistics.median(gaps)}


def _row(name: str, alone: dict, busy: dict, streams: int) -> str:
    itl_ratio = busy["itl_b1_ms"] / alone["itl_b1_ms"]
    tput_ratio = busy["throughput_tok_s"] / alone["throughput_tok_s"]
    ok = itl_ratio <= MAX_ITL_RATIO and tput_ratio >= MIN_THROUGHPUT_RATIO
    key = f"itl_b{streams}_ms"
    return (f"| {name} | {alone['itl_b1_ms']:.1f} | {busy['itl_b1_ms']:.1f} | {itl_ratio:.1f}x "
            f"| {alone['throughput_tok_s']:.1f} | {busy['throughput_tok_s']:.1f} | "
            f"{tput_ratio:.2f}x | {alone[key]:.1f} / {busy[key]:.1f} | "
            f"{'yes' if ok else 'no'} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=128, help="tokens per answer")
    parser.add_argument("--repeats", type=int, default=3, help="batch-1 answers per figure")
    parser.add_argument("--streams", type=int, default=8, help="concurrent answers")
    parser.add_argument("--busy-core", type=int, default=None,
                        help="core the busy process takes (default: the highest usable one)")
    parser.add_argument("--out", type=Path, default=None, help="also write the figures as JSON")
    parser.add_argument("--logs", type=Path, default=Path(tempfile.gettempdir()),
                        help="folder for the servers' logs")
    args = parser.parse_args()
    default_threads = cpu_budget().cpus
    core = max(os.sched_getaffinity(0)) if args.busy_core is None else args.busy_core
    targets = [(f"kvledger serve (default: a team of up to {default_threads} threads)",
                lambda: kvledger_server(None, args.logs / "contention-kvledger.log")),
               (f"kvledger serve --threads {default_threads} (fixed team)",
                lambda: kvledger_server(default_threads,
                                        args.logs / "contention-kvledger-fixed.log"))]
    if peer_llamacpp.binary("llama-server") is not None:
        targets.append((f"llama-server -t {default_threads} -np {args.streams}",
                        lambda: llama_server(default_threads, args.streams,
                                             args.logs / "contention-llama.log")))
    print(machine_line(default_threads))
    print(f"{args.tokens}-token chat answers; busy process on core {core}; batch-1 ITL: median "
          f"of {args.repeats} answers' medians; batch {args.streams}: output tok/s")
    rows, figures = [], {}
    for name, start in targets:
        with start() as url:
            alone = measure(url, args.tokens, args.repeats, args.streams)
            with busy_core(core):
                busy = measure(url, args.tokens, args.repeats, args.streams)
        figures[name] = {"alone": alone, "busy": busy}
        rows.append(_row(name, alone, busy, args.streams))
    if peer_llamacpp.binary("llama-server") is None:
        rows.append(f"| {peer_llamacpp.skip_reason('llama-server')} | | | | | | | | |")
    print(f"| server | ITL b1 alone (ms) | ITL b1 busy (ms) | ratio | tok/s b{args.streams} alone "
          f"| tok/s b{args.streams} busy | ratio | ITL b{args.streams} alone / busy (ms) "
          f"| target met |")
    print("|---|---|---|---|---|---|---|---|---|")
    print("\n".join(rows))
    if args.out:
        args.out.write_text(json.dumps(figures, indent=1))


if __name__ == "__main__":
    main()
