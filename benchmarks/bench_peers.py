"""kvledger against llama.cpp on the bundled GGUF, same threads, in one run (issue 10).

1. Batch 1: our TTFT and TPOT with 512, 2048 and 4096-token prompts (64 new tokens, greedy,
   EOS ignored, the default fast mode), next to ``llama-bench``'s decode (tg64 at depth 0 /
   512 / 4096) and prefill (pp512) on the same file, for llama.cpp and for ik_llama.cpp with
   its best CPU flags (``-rtr 1 -fa 1``, issue 55), and our TPOT over each peer's.
2. Over HTTP: ``kvledger serve`` and ``llama-server -np 16``, each driven by ``kvledger bench``
   (completions, 32 requests of 250-token real-text prompts, 128 new tokens, concurrency 16;
   prompts cut with the same GGUF tokenizer, so both get the same prompts): output tok/s.
3. Peak RSS of ``kvledger generate`` (16 new tokens, ``/usr/bin/time -v``) next to the KV pool's
   reserved bytes and the bytes its blocks in use hold (an unwritten pool page costs no RAM), and
   of ``llama-bench`` decoding 16 tokens; the HTTP part reports each server's peak RSS after
   its run (``VmHWM``, read before it is stopped).

llama.cpp comes from ``$KVLEDGER_LLAMA_CPP_DIR``, ik_llama.cpp from ``$KVLEDGER_IK_LLAMA_DIR``
(``peer_llamacpp.py``; batch 1 only); without one its rows are skipped with a message. Usage:
python benchmarks/bench_peers.py [--threads 2] [--out bench-peers] [--skip-http] [--skip-batch1]
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
from pathlib import Path

import peer_llamacpp as peer
import torch
from common import machine_line, peak_rss_bytes, real_text_ids, tpot_floor_ms

from kvledger import LLM, SamplingParams
from kvledger.paths import bundled_model_path

HTTP_ARGS = ["--workload", "sweep", "--endpoint", "completions", "--prompt-lens", "250",
             "--output-len", "128", "--concurrency", "16", "--requests", "32", "--warmup", "0"]


def ours_batch1(threads: int, contexts: tuple[int, ...], new: int) -> dict:
    llm = LLM("default", enable_prefix_caching=False, num_threads=threads)
    params = SamplingParams(max_tokens=new, temperature=0.0, ignore_eos=True)
    llm.generate([real_text_ids(llm.tokenizer, 64)], params)  # warm-up
    model = llm.engine.model
    result = {"formats": model.weight_formats, "attention": model.attention.name,
              "weight_bytes": model.decode_weight_bytes,
              "kv_bytes_per_token": llm.engine.bytes_per_token}
    for ctx in contexts:
        out = llm.generate([real_text_ids(llm.tokenizer, ctx)], params)[0]
        result[ctx] = {"ttft_ms": out.metrics.ttft_s * 1e3, "tpot_ms": out.tpot_s * 1e3}
    return result


def llama_batch1(threads: int, depths: tuple[int, ...], new: int,
                 which: peer.Peer = peer.LLAMA_CPP) -> dict | None:
    """{("pp" | "tg", depth): tok/s} of ``which``'s llama-bench on the bundled GGUF, or None
    (the reason printed) when it is absent or failed."""
    if peer.binary("llama-bench", which) is None:
        print(" ", peer.skip_reason("llama-bench", which))
        return None
    try:
        rows = peer.llama_bench(bundled_model_path(), threads, 512, new, (0, *depths),
                                peer=which)
    except RuntimeError as e:
        print(f"  {e}")
        return None
    result = {}
    for row in rows:
        kind = "pp" if row["n_prompt"] else "tg"
        result[(kind, row["n_depth"])] = row["avg_ts"]
    return result


def batch1(args) -> None:
    contexts = (512, 2048, 4096)
    print(f"batch 1, {args.new} new tokens, context {' / '.join(map(str, contexts))}:")
    ours = ours_batch1(args.threads, contexts, args.new)
    print(f"  kvledger (attention {ours['attention']}, weights {ours['formats']}: "
          f"{ours['weight_bytes'] / 1e6:.1f} MB; KV {ours['kv_bytes_per_token']:,} B/token)")
    for ctx in contexts:
        floor = tpot_floor_ms(ours["weight_bytes"], ctx * ours["kv_bytes_per_token"])
        ratio = "" if floor is None else \
            f"   floor {floor:5.1f} ms -> {ours[ctx]['tpot_ms'] / floor:.1f}x (target <= 3x)"
        print(f"    context {ctx:5d}: TTFT {ours[ctx]['ttft_ms']:8.1f} ms   "
              f"TPOT {ours[ctx]['tpot_ms']:6.1f} ms{ratio}")
    for which in (peer.LLAMA_CPP, peer.IK_LLAMA):
        theirs = llama_batch1(args.threads, (512, 4096), args.new, which)
        if not theirs:
            continue
        print(f"  {which.label} (llama-bench {' '.join(which.flags)}, same GGUF)")
        for depth in (0, 512, 4096):
            tg, pp = theirs.get(("tg", depth)), theirs.get(("pp", depth))
            ratio = f"   our TPOT / theirs {ours[depth]['tpot_ms'] * tg / 1e3:.2f}x" \
                if depth in ours and tg else ""
            if depth == 0 and pp:
                ratio = f"   our TTFT 512 / theirs {ours[512]['ttft_ms'] * pp / 512e3:.2f}x"
            line = f"    depth {depth:5d}: tg{args.new} {tg:6.1f} tok/s (TPOT {1e3 / tg:6.1f} ms)"
            if pp:  # llama.cpp's pp512 after a prefix is not a TTFT; ik_llama.cpp's is at 0
                what = "TTFT" if depth == 0 else "its time"
                line += f"   pp512 {pp:7.1f} tok/s ({what} {512e3 / pp:8.1f} ms)"
            print(line + ratio)


def _bench_url(url: str, out: Path, log: Path) -> float | None:
    cmd = [sys.executable, "-m", "kvledger.cli", "bench", "--url", url, "--out", str(out),
           "--tokenizer", str(bundled_model_path()), *HTTP_ARGS]
    with open(log, "w") as fh:
        done = subprocess.run(cmd, stdout=fh, stderr=subprocess.STDOUT, check=False)
    if done.returncode != 0:
        print(f"  kvledger bench failed (see {log})")
        return None
    summary = json.loads((out / "results.json").read_text())["summaries"][0]
    return summary["output_throughput_tok_s"]


def http(args, out: Path) -> None:
    print("HTTP, kvledger bench:", " ".join(HTTP_ARGS))
    port = args.port
    serve = [sys.executable, "-m", "kvledger.cli", "serve", "--port", str(port),
             "--threads", str(args.threads)]
    with open(out / "serve.log", "w") as log:
        proc = subprocess.Popen(serve, stdout=log, stderr=subprocess.STDOUT)
        try:
            peer.wait_healthy(f"http://127.0.0.1:{port}", proc)
            ours = _bench_url(f"http://127.0.0.1:{port}", out / "ours", out / "ours.txt")
            ours_rss = peak_rss_bytes(proc.pid)
        finally:
            peer.stop(proc)
    print(f"  kvledger serve           {ours or float('nan'):6.1f} output tok/s; "
          f"peak RSS {_gb(ours_rss)}")
    if peer.binary("llama-server") is None:
        print(" ", peer.skip_reason("llama-server"))
        return
    with peer.Server(bundled_model_path(), port + 1, args.threads, log=out / "llama.log") as srv:
        theirs = _bench_url(srv.url, out / "llamacpp", out / "llamacpp.txt")
        theirs_rss = peak_rss_bytes(srv.proc.pid)
    print(f"  llama-server -np 16      {theirs or float('nan'):6.1f} output tok/s; "
          f"peak RSS {_gb(theirs_rss)} (-c 32768: its KV for 32,768 tokens allocated)")
    if ours and theirs:
        print(f"  ratio ours / llama.cpp   {ours / theirs:6.2f}x (target >= 1.5x)")


def _gb(nbytes: int | None) -> str:
    return "n/a" if nbytes is None else f"{nbytes / 1e9:.3f} GB"


def _time_v(cmd: list[str]) -> tuple[subprocess.CompletedProcess, int | None]:
    """Run ``cmd`` under ``/usr/bin/time -v``; the process and its peak RSS in bytes."""
    done = subprocess.run(["/usr/bin/time", "-v", *cmd], capture_output=True, text=True,
                          check=False)
    rss = re.search(r"Maximum resident set size \(kbytes\): (\d+)", done.stderr)
    return done, int(rss.group(1)) * 1024 if done.returncode == 0 and rss else None


def peak_rss(args) -> None:
    """Peak RSS of `kvledger generate`, its KV pool reserved and written (from --json), and of
    `llama-bench` decoding the same number of tokens."""
    exe = peer.binary("llama-bench")
    if exe is not None:
        _, rss_b = _time_v([str(exe), "-m", str(bundled_model_path()), "-t", str(args.threads),
                            "-p", "0", "-n", "16", "-r", "1"])
        print(f"  llama-bench tg16: peak RSS {_gb(rss_b)}")
    cmd = [sys.executable, "-m", "kvledger.cli", "generate",
           "The KV cache stores", "--max-tokens", "16", "--json", "--threads", str(args.threads)]
    done, rss_b = _time_v(cmd)
    if rss_b is None:
        print(f"  peak RSS: could not run {' '.join(cmd[:3])} ({done.stderr.strip()[-200:]})")
        return
    doc = json.loads(done.stdout.strip().splitlines()[-1])
    written = doc["metrics"]["kv_bytes_held"]
    print(f"  kvledger generate, 16 tokens: peak RSS {rss_b / 1e9:.3f} GB; KV pool reserved "
          f"{doc['kv_pool_bytes'] / 1e9:.3f} GB, of which written {written / 1e9:.4f} GB (pages "
          f"are mapped on first write); RSS minus written KV {(rss_b - written) / 1e9:.3f} GB "
          "(target <= 0.5 GB)")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--new", type=int, default=64)
    ap.add_argument("--port", type=int, default=8791)
    ap.add_argument("--out", default="bench-peers")
    ap.add_argument("--skip-batch1", action="store_true")
    ap.add_argument("--skip-http", action="store_true")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    print(machine_line(args.threads))
    if not args.skip_batch1:
        batch1(args)
    if not args.skip_http:
        http(args, out)
    peak_rss(args)


if __name__ == "__main__":
    main()
