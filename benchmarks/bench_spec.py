"""Speculative decoding at batch 1 and over HTTP: output tok/s with and without proposals.

Batch 1 (in process, the bundled model, greedy, EOS ignored so every run emits ``--new``
tokens): three kinds of prompt, the issue's (a function to edit and return whole, a summary
that quotes its source, open chat), each under speculation ``off``, ``ngram``, ``suffix`` and
``auto`` (gated); output tok/s = (tokens - 1) / (last token - first token), the median of
``--repeat`` runs after a warm-up; speed-up = over ``off``. With ``$KVLEDGER_LLAMA_CPP_DIR``
(llama-server), the same chat prompts through llama.cpp's server with each ``--spec-type
ngram-*`` it lists in ``--help`` (its ``timings.predicted_per_second``), in the same run.

HTTP (``--http``): ``kvledger serve`` with ``off`` and with ``auto``, closed-loop clients at
concurrency 1 / 4 / 16 sending the three prompts in turn (EOS ignored); output tok/s = tokens /
wall time of the round; the auto server's accepted / proposed tokens per concurrency (its
``/metrics``).

Usage: python benchmarks/bench_spec.py [--threads 2] [--new 128] [--repeat 3] [--http]
       [--skip-batch1] [--kinds "code rewrite,quoting summary,open chat"]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
from common import machine_line
from peer_llamacpp import Server, binary, skip_reason, stop, wait_healthy

from kvledger import LLM, SamplingParams

CODE = '''def parse_records(lines, sep=","):
    records = []
    for i, line in enumerate(lines):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        parts = [p.strip() for p in line.split(sep)]
        if len(parts) != 3:
            raise ValueError(f"line {i}: expected 3 fields, got {len(parts)}")
        name, age, city = parts
        records.append({"name": name, "age": int(age), "city": city})
    return records
'''
SOURCE = ("The Rhine is a river that begins in the Swiss Alps and flows north through Germany "
          "before reaching the North Sea in the Netherlands. It is about 1,230 kilometres long. "
          "For centuries the Rhine has been one of the most important trade routes in Europe, "
          "carrying coal, grain and timber between inland cities and the sea. Castles built on "
          "its cliffs once collected tolls from passing ships. Today the river is also known for "
          "its vineyards, and the Rhine Gorge between Bingen and Koblenz is a UNESCO World "
          "Heritage Site.")
PROMPTS = {
    "code rewrite": "Rename the function parse_records to read_records and the variable "
                    "records to rows. Return the whole edited function, nothing else.\n\n"
                    + CODE,
    "quoting summary": "Summarize this text in a few sentences, quoting its key sentences "
                       "word for word:\n\n" + SOURCE,
    "open chat": "Tell me a short story about a lighthouse keeper who finds a message in a "
                 "bottle.",
}
MODES = {"off": None, "ngram": {"method": "ngram"}, "suffix": {"method": "suffix"},
         "auto": {"method": "auto"}}


def batch1(threads: int, new: int, repeat: int, kinds: list[str]) -> dict:
    """{(prompt kind, mode): (output tok/s, accepted, proposed)}; the modes' engines take
    turns run by run, so a shared machine's load falls on all of them alike."""
    results = {}
    params = SamplingParams(max_tokens=new, temperature=0.0, ignore_eos=True)
    llms = {mode: LLM(num_threads=threads, speculative_config=config)
            for mode, config in MODES.items()}
    for kind in kinds:
        chat = [{"role": "user", "content": PROMPTS[kind]}]
        rates = {mode: [] for mode in MODES}
        before = {mode: llm.engine.stats() for mode, llm in llms.items()}
        for i in range(repeat + 1):  # the first run warms up (and indexes one suffix output)
            for mode, llm in llms.items():
                out = llm.generate([chat], params)[0]
                m = out.metrics
                if i:
                    rates[mode].append((len(out.token_ids) - 1)
                                       / (m.last_token_time - m.first_token_time))
        for mode, llm in llms.items():
            after = llm.engine.stats()
            counts = [after.get(k, 0) - before[mode].get(k, 0)
                      for k in ("spec_accepted_tokens", "spec_proposed_tokens")]
            results[kind, mode] = (statistics.median(rates[mode]), *counts)
            print(f"batch 1 · {kind:16s} · {mode:6s}: {results[kind, mode][0]:6.1f} tok/s, "
                  f"accepted {counts[0]}/{counts[1]}", flush=True)
    for llm in llms.values():
        llm.close()
    return results


def llamacpp_spec_types() -> list[str]:
    """The ``ngram-*`` spec types ``llama-server --help`` lists ([] without llama-server)."""
    exe = binary("llama-server")
    if exe is None:
        return []
    text = subprocess.run([str(exe), "--help"], capture_output=True, text=True,
                          check=False).stdout
    line = next((ln for ln in text.splitlines() if ln.startswith("--spec-type")), "")
    listed = line.split()[1].split(",") if len(line.split()) > 1 else []
    return [t for t in listed if re.fullmatch(r"ngram-[a-z0-9-]+", t)]


def llamacpp_batch1(threads: int, new: int, repeat: int, port: int, kinds: list[str]) -> dict:
    """{(prompt kind, spec type or 'off'): output tok/s} through llama-server."""
    from kvledger.paths import bundled_model_path

    results = {}
    for spec in ["off", *llamacpp_spec_types()]:
        extra = () if spec == "off" else ("--spec-type", spec)
        with Server(bundled_model_path(), port, threads, parallel=1, context=4096,
                    extra=extra) as server:
            for kind in kinds:
                body = {"messages": [{"role": "user", "content": PROMPTS[kind]}],
                        "max_tokens": new,
                        "temperature": 0.0, "ignore_eos": True}
                rates = []
                for i in range(repeat + 1):
                    r = httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=600)
                    if i:
                        rates.append(r.json()["timings"]["predicted_per_second"])
                results[kind, spec] = statistics.median(rates)
                print(f"llama.cpp · {kind:16s} · {spec:18s}: {results[kind, spec]:6.1f} tok/s",
                      flush=True)
    return results


def _serve(config: dict | None, threads: int, port: int) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "kvledger.cli", "serve", "--port", str(port), "--threads",
           str(threads)]
    if config is not None:
        cmd += ["--speculative-config", json.dumps(config)]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    wait_healthy(f"http://127.0.0.1:{port}", proc)
    return proc


def http_round(port: int, concurrency: int, new: int, rounds: int) -> float:
    """Output tok/s of ``concurrency`` closed-loop clients, each sending ``rounds`` requests
    (the prompts in turn)."""
    kinds = list(PROMPTS)
    model = httpx.get(f"http://127.0.0.1:{port}/v1/models").json()["data"][0]["id"]

    def client(c: int) -> int:
        n = 0
        with httpx.Client(timeout=1200) as http:
            for r in range(rounds):
                text = PROMPTS[kinds[(c + r) % len(kinds)]]
                body = {"model": model, "max_tokens": new, "temperature": 0.0,
                        "ignore_eos": True, "messages": [{"role": "user", "content": text}]}
                n += http.post(f"http://127.0.0.1:{port}/v1/chat/completions",
                               json=body).json()["usage"]["completion_tokens"]
        return n

    t = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as pool:
        tokens = sum(pool.map(client, range(concurrency)))
    return tokens / (time.perf_counter() - t)


def spec_counts(port: int) -> tuple[float, float]:
    """(accepted, proposed) speculative tokens so far, from the server's ``/metrics``."""
    text = httpx.get(f"http://127.0.0.1:{port}/metrics").text
    pattern = r"^kvledger:spec_(accepted|proposed)_tokens_total(?:\{[^}]*\})? (\S+)$"
    found = dict(re.findall(pattern, text, re.MULTILINE))
    return float(found.get("accepted", 0)), float(found.get("proposed", 0))


def http(threads: int, new: int, port: int) -> dict:
    """{(concurrency, mode): output tok/s} for modes off and auto: both servers up at once,
    rounds alternated off, auto, auto, off (a shared machine's load falls on both alike);
    also {(concurrency, "drafts"): (accepted, proposed)} of the auto server's rounds."""
    ports = {"off": port, "auto": port + 2}
    procs = []
    try:
        for mode, p in ports.items():
            procs.append(_serve(MODES[mode], threads, p))
            http_round(p, 1, 16, 1)  # warm-up
        results = {}
        for concurrency in (1, 4, 16):
            rates = {"off": [], "auto": []}
            before = spec_counts(ports["auto"])
            for mode in ("off", "auto", "auto", "off"):
                rates[mode].append(http_round(ports[mode], concurrency, new, rounds=1))
            for mode, r in rates.items():
                results[concurrency, mode] = statistics.mean(r)
            after = spec_counts(ports["auto"])
            results[concurrency, "drafts"] = tuple(int(a - b) for a, b in zip(after, before))
            print(f"HTTP concurrency {concurrency:2d}: off {results[concurrency, 'off']:6.1f} "
                  f"tok/s, auto {results[concurrency, 'auto']:6.1f} tok/s", flush=True)
        return results
    finally:
        for proc in procs:
            stop(proc)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--new", type=int, default=128)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--port", type=int, default=18456)
    ap.add_argument("--http", action="store_true", help="also the HTTP concurrency runs")
    ap.add_argument("--skip-batch1", action="store_true")
    ap.add_argument("--peer-only", action="store_true", help="batch 1: llama.cpp only")
    ap.add_argument("--kinds", default=",".join(PROMPTS),
                    help="prompt kinds of the batch-1 runs, comma-separated")
    args = ap.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", str(args.threads))
    print(machine_line(args.threads), "· load", os.getloadavg())
    kinds = args.kinds.split(",")
    if not (args.skip_batch1 or args.peer_only):
        ours = batch1(args.threads, args.new, args.repeat, kinds)
        for kind in kinds:
            off = ours[kind, "off"][0]
            for mode in MODES:
                rate, acc, prop = ours[kind, mode]
                share = f", accepted {acc}/{prop}" if prop else ""
                print(f"batch 1 · {kind:16s} · {mode:6s}: {rate:6.1f} tok/s "
                      f"({rate / off:.2f}x{share})")
    if not args.skip_batch1 or args.peer_only:
        if binary("llama-server") is None:
            print(skip_reason("llama-server"))
        else:
            peer = llamacpp_batch1(args.threads, args.new, args.repeat, args.port + 1, kinds)
            for (kind, spec), rate in peer.items():
                off = peer[kind, "off"]
                print(f"llama.cpp · {kind:16s} · {spec:18s}: {rate:6.1f} tok/s "
                      f"({rate / off:.2f}x)")
    if args.http:
        res = http(args.threads, args.new, args.port)
        for c in (1, 4, 16):
            off, auto = res[c, "off"], res[c, "auto"]
            acc, prop = res[c, "drafts"]
            print(f"HTTP concurrency {c:2d}: off {off:6.1f} tok/s, auto {auto:6.1f} tok/s "
                  f"({auto / off:.2f}x; auto accepted {acc}/{prop})")
    print("load after", os.getloadavg())


if __name__ == "__main__":
    main()
