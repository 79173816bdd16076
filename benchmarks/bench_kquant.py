"""K-quant GGUFs held as the file's blocks against llama.cpp on the same file, same threads, in
one run (issue 42).

For each GGUF (e.g. those of ``kquant_models.py``): our batch-1 TTFT and TPOT with 512 and
2,048-token real-text prompts (``--new`` tokens, greedy, EOS ignored, the default fast mode), the
weight formats the probe chose and the bytes held, next to ``llama-bench``'s decode (tg at depth
512 / 2,048) and prefill (pp512); then the peak RSS of ``kvledger generate`` (16 new tokens,
``/usr/bin/time -v``) against the file's size.

llama.cpp comes from ``$KVLEDGER_LLAMA_CPP_DIR`` (``peer_llamacpp.py``). Usage:
python benchmarks/bench_kquant.py GGUF... [--threads 2] [--new 32]
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
from pathlib import Path

import peer_llamacpp as peer
from common import machine_line, real_text_ids

from kvledger import LLM, SamplingParams

CONTEXTS = (512, 2048)


def ours(path: Path, threads: int, new: int) -> dict:
    llm = LLM(str(path), enable_prefix_caching=False, num_threads=threads)
    params = SamplingParams(max_tokens=new, temperature=0.0, ignore_eos=True)
    llm.generate([real_text_ids(llm.tokenizer, 64)], params)  # warm-up
    model = llm.engine.model
    result = {"formats": model.weight_formats, "weight_bytes": model.weight_bytes}
    for ctx in CONTEXTS:
        out = llm.generate([real_text_ids(llm.tokenizer, ctx, offset=ctx)], params)[0]
        result[ctx] = (out.metrics.ttft_s * 1e3, out.tpot_s * 1e3)
    return result


def peak_rss_gb(cmd: list[str]) -> float | None:
    """Peak RSS of ``cmd`` in GB (``/usr/bin/time -v``), None when it failed."""
    done = subprocess.run(["/usr/bin/time", "-v", *cmd], capture_output=True, text=True,
                          check=False)
    rss = re.search(r"Maximum resident set size \(kbytes\): (\d+)", done.stderr)
    return int(rss.group(1)) * 1024 / 1e9 if done.returncode == 0 and rss else None


def _gb(gb: float | None) -> str:
    return "n/a" if gb is None else f"{gb:.3f} GB"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("gguf", nargs="+", type=Path)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--new", type=int, default=32)
    args = ap.parse_args()
    print(machine_line(args.threads))
    for path in args.gguf:
        size = path.stat().st_size / 1e9
        mine = ours(path, args.threads, args.new)
        print(f"{path.name}: file {size:.3f} GB; held {mine['weight_bytes'] / 1e9:.3f} GB "
              f"as {mine['formats']}")
        rows = {}
        if peer.binary("llama-bench") is None:
            print(" ", peer.skip_reason("llama-bench"))
        else:
            for row in peer.llama_bench(path, args.threads, 512, args.new, (0, *CONTEXTS)):
                rows[("pp" if row["n_prompt"] else "tg", row["n_depth"])] = row["avg_ts"]
        for ctx in CONTEXTS:
            ttft, tpot = mine[ctx]
            tg = rows.get(("tg", ctx))
            theirs = "" if tg is None else \
                f"   llama.cpp {1e3 / tg:6.1f} ms -> {tpot * tg / 1e3:.2f}x (target <= 0.9x)"
            print(f"  TPOT at {ctx:5d}: {tpot:6.1f} ms{theirs}   (our TTFT {ttft:8.1f} ms)")
        pp = rows.get(("pp", 0))
        if pp is not None:
            ttft = mine[512][0]
            print(f"  TTFT of 512: {ttft:8.1f} ms   llama.cpp pp512 {512e3 / pp:8.1f} ms -> "
                  f"{ttft * pp / 512e3:.2f}x (target <= 0.8x)")
        rss = peak_rss_gb([sys.executable, "-m", "kvledger.cli", "generate", "The KV cache",
                           "--model", str(path), "--max-tokens", "16",
                           "--threads", str(args.threads)])
        exe = peer.binary("llama-bench")
        theirs = None if exe is None else peak_rss_gb(
            [str(exe), "-m", str(path), "-t", str(args.threads), "-p", "0", "-n", "16", "-r", "1"])
        print(f"  peak RSS, 16 new tokens: kvledger generate {_gb(rss)} (target <= "
              f"{size + 0.3:.3f} GB), llama-bench {_gb(theirs)}")


if __name__ == "__main__":
    main()
