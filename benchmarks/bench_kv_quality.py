"""What each KV format costs in quality and buys in capacity, on the bundled model.

Quality: ``kvledger eval perplexity``'s protocol (llama.cpp's: non-overlapping chunks of
``--context`` tokens, second half scored, fed in the engine's prefill chunk of 2,048 tokens
unless ``--stride`` says otherwise) on Python's
``pydoc_data.topics`` text (or ``--text FILE``), for fp8 / int8 / int4 / int3 / int2 (per-channel and per-token
keys, with and without fp16 outlier channels or a Hadamard rotation; key groups of G tokens
and a full-precision window of R, fed ``--stride`` tokens per step), each against a base run
in lockstep (``--base``, default fp16 KV as llama.cpp's f16): ΔPPL, the KL divergence's mean,
maximum, 99.9 % / 99.0 % percentiles and median, top-1 agreement. fp32 compute. Accuracy
figures do not depend on machine load. A label that names no window, key group or intact
tokens (``int4 + rotation``) runs the format's defaults (int4 / int3 / int2: R 128, the first
32 tokens intact, int3 / int2 keys over 32 tokens); the ``G``/``R`` labels keep no intact
tokens unless they say ``intact N``.

Peer (same text file, same GGUF): ``llama-perplexity`` with ``-ctk/-ctv`` f16, q8_0, q4_0 when
``$KVLEDGER_LLAMA_CPP_DIR`` names a folder holding it (skipped otherwise); the f16 run saves
its logits (``--kl-divergence-base``) and the others report their KLD against it. Its log
says whether it rotated K/V (``n_rot_k``, its PR #21038).

Capacity, per variant run (same key group and window): the effective bits per K/V element of
one 4K request (codes, scales, zero points and the bf16 full-precision window included, as
``kvledger plan`` prices it), ``kvledger plan``'s concurrency at 4K on an H100-SXM, and 4K-token
requests that fit in a 256 MiB KV budget: the engine's pool (blocks after the residual buffers)
/ blocks per request, next to the ledger's figure.

Pass key (``--passkey-depths N``, alone with ``--passkey-only``): ``kvledger eval passkey``'s
trial (a 5-digit key hidden in filler, asked for at the end, greedy answer) at ``--context``
for N depths evenly spread over [0, 1], per KV format, bf16 compute (the default mode). The depths run deepest first, so each
prompt finds the filler before its key in the prefix cache (the answers do not change: cold
and warm runs give the same tokens).

    python benchmarks/bench_kv_quality.py [--context 2048] [--chunks 4] [--stride 16] [--base fp16]
        [--text FILE]
        [--only LABELS] [--no-peer] [--peer-threads 2] [--json OUT]
        [--passkey-depths 10 [--passkey-only]]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import subprocess
import tempfile
import time
from datetime import date
from pathlib import Path

from common import machine_line

VARIANTS = [  # label, EngineConfig overrides
    ("fp8", {"kv_cache_dtype": "fp8"}),
    ("int8", {"kv_cache_dtype": "int8"}),
    ("int8 per-token keys", {"kv_cache_dtype": "int8", "kv_key_quant": "per-token"}),
    ("int4", {"kv_cache_dtype": "int4"}),
    ("int4 per-token keys", {"kv_cache_dtype": "int4", "kv_key_quant": "per-token"}),
    ("int4 + 4 outliers", {"kv_cache_dtype": "int4", "kv_outlier_channels": 4}),
    ("int4 per-token keys + 4 outliers",
     {"kv_cache_dtype": "int4", "kv_key_quant": "per-token", "kv_outlier_channels": 4}),
    ("int8 + rotation", {"kv_cache_dtype": "int8", "kv_rotation": "hadamard"}),
    ("int4 + rotation", {"kv_cache_dtype": "int4", "kv_rotation": "hadamard"}),
    ("int3", {"kv_cache_dtype": "int3"}),
    ("int3 + rotation", {"kv_cache_dtype": "int3", "kv_rotation": "hadamard"}),
    ("int2", {"kv_cache_dtype": "int2"}),
    ("int2 + rotation", {"kv_cache_dtype": "int2", "kv_rotation": "hadamard"}),
    *((f"{f} per-token keys + rotation", {"kv_cache_dtype": f, "kv_key_quant": "per-token",
                                          "kv_rotation": "hadamard"})
      for f in ("int4", "int3", "int2")),
    # key groups (G tokens) and the full-precision window (R tokens), no intact tokens (the
    # labels above run each format's defaults: docs/kv-formats.md); run them with
    # --stride 16 to see the window as generation does
    *((f"{f}{rot}, R 128", {"kv_cache_dtype": f, "kv_residual_tokens": 128,
                            "kv_intact_tokens": 0, "kv_rotation": "hadamard" if rot else "none"})
      for f in ("int8", "int4") for rot in ("", " + rotation")),
    *((f"{f}{rot}, G {g}, R {r}", {"kv_cache_dtype": f, "kv_key_group_tokens": g,
                                   "kv_residual_tokens": r, "kv_intact_tokens": 0,
                                   "kv_rotation": "hadamard" if rot else "none"})
      for f in ("int8", "int4", "int3", "int2") for rot in ("", " + rotation")
      for g, r in ((16, 16), (32, 128), (64, 128)) if f in ("int3", "int2") or g == 32),
]
# the issue-41 rows again with the first N tokens (the attention sinks) at full precision
VARIANTS += [(f"{label}, intact {n}", {**over, "kv_intact_tokens": n})
             for n in (32, 64) for label, over in VARIANTS
             if label in ("int8, R 128", "int4 + rotation, R 128",
                          "int3 + rotation, G 32, R 128", "int2 + rotation, G 32, R 128")]
LLAMA_CACHE_TYPES = ("f16", "q8_0", "q4_0")
PASSKEY_VARIANTS = [("bf16", {"kv_cache_dtype": "bf16"}), *VARIANTS]


def quality(context: int, chunks: int, variants, base_kv: str, stride: int | None = None,
            on_chunk=None, text_path: Path | None = None) -> tuple[list[dict], str]:
    """One row per variant over the chunks of ``text_path`` (None: the pydoc topics), every
    variant against ONE base run per chunk (``perplexity_runs``); ``on_chunk(rows)`` after
    each chunk with the figures so far."""
    import torch

    from kvledger.engine.config import EngineConfig
    from kvledger.engine.engine import LLMEngine
    from kvledger.eval.corpus import read_text
    from kvledger.eval.perplexity import perplexity_runs
    from kvledger.eval.scoring import eval_config
    from kvledger.model.weights.loader import load_tokenizer, load_weights

    spec, weights = load_weights("default", torch.float32)
    tokenizer = load_tokenizer("default")
    text, _ = read_text(text_path)
    ids = tokenizer.encode(text, add_special_tokens=False)
    base_cfg = eval_config(EngineConfig(dtype="fp32", kv_cache_dtype=base_kv), context)
    base = LLMEngine(base_cfg, spec=spec, weights=weights, tokenizer=tokenizer)
    engines = [LLMEngine(dataclasses.replace(base_cfg, **over), spec=spec, weights=weights,
                         tokenizer=tokenizer) for _, over in variants]
    t0, rows = time.perf_counter(), []
    for results in perplexity_runs(engines, ids, context, stride, chunks, base):
        rows = []
        for (label, _), engine, r in zip(variants, engines, results):
            rows.append({"variant": label, "layout": engine.kv_layout.describe(),
                         "bytes_per_token": engine.bytes_per_token, **r.to_json()})
            print(f"{label:34s} chunks {r.chunks} ppl {r.ppl:.4f} base {r.ppl_base:.4f} "
                  f"dppl {r.delta_ppl_pct:+.3f}% kld {r.kld_mean:.5f} p99 {r.kld_p99:.4f} "
                  f"max {r.kld_max:.3f} top1 {r.top1_agreement:.4f}", flush=True)
        print(f"{time.perf_counter() - t0:.0f} s so far", flush=True)
        if on_chunk is not None:
            on_chunk(rows)
    return rows, text


def passkey_accuracy(context: int, depths: int, variants, trials: int = 1,
                     seed: int = 0) -> list[dict]:
    """``trials`` pass keys (drawn from ``seed``) at each of ``depths`` evenly spread depths per
    format of PASSKEY_VARIANTS, in the default mode (bf16 compute, every format read by the
    native kernel; with fp32 compute a bf16 pool falls back to the PyTorch backend, ~10x
    slower at 4K)."""
    import torch

    from kvledger.engine.config import EngineConfig
    from kvledger.engine.engine import LLMEngine
    from kvledger.eval.passkey import passkey
    from kvledger.eval.scoring import eval_config
    from kvledger.model.weights.loader import load_tokenizer, load_weights

    spec, weights = load_weights("default", torch.bfloat16)
    tokenizer = load_tokenizer("default")
    at = sorted((round(i / (depths - 1), 3) if depths > 1 else 0.5 for i in range(depths)),
                reverse=True)
    rows = []
    for label, over in variants:
        cfg = eval_config(EngineConfig(dtype="bf16", **over), context)
        engine = LLMEngine(cfg, spec=spec, weights=weights, tokenizer=tokenizer)
        r = passkey(engine, context, at, trials, seed)
        rows.append({"variant": label, **r.to_json()})
        print(f"passkey {label:20s} {100 * r.accuracy:5.1f} % "
              f"({sum(t.retrieved for t in r.trials)}/{len(r.trials)}); missed at "
              f"{[t.depth for t in r.trials if not t.retrieved]}", flush=True)
        del engine
    return rows


LLAMA_KLD = {"kld_mean": r"Mean\s+KLD:\s+([0-9.e+-]+)", "kld_max": r"Maximum KLD:\s+([0-9.e+-]+)",
             "kld_p999": r"99\.9%\s+KLD:\s+([0-9.e+-]+)", "kld_p99": r"99\.0%\s+KLD:\s+([0-9.e+-]+)",
             "kld_median": r"Median\s+KLD:\s+([0-9.e+-]+)",
             "top1_agreement": r"Same top p:\s+([0-9.]+)"}


def _llama_run(cmd: list[str]) -> str:
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=3600, check=False)
    return done.stdout + done.stderr


def llama_cpp(text: str, context: int, chunks: int, threads: int = 2) -> dict | None:
    """llama-perplexity per KV cache type on the same text, on ``threads`` threads: PPL, and
    the KLD against its f16 run (``--kl-divergence-base`` then ``--kl-divergence``); None
    without the binary."""
    folder = os.environ.get("KVLEDGER_LLAMA_CPP_DIR")
    binary = Path(folder or "/nonexistent") / "llama-perplexity"
    if not binary.is_file():
        print("llama.cpp: skipped (set KVLEDGER_LLAMA_CPP_DIR to a folder with llama-perplexity)")
        return None
    from kvledger.paths import bundled_model_path

    version = _llama_run([str(binary), "--version"]).strip().splitlines()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        text_file, logits = Path(tmp) / "text.txt", Path(tmp) / "f16.logits"
        text_file.write_text(text)
        for cache in LLAMA_CACHE_TYPES:
            cmd = [str(binary), "-m", str(bundled_model_path()), "-c", str(context),
                   "--chunks", str(chunks), "-t", str(threads), "-fa", "on", "-ctk", cache, "-ctv", cache,
                   "--kl-divergence-base", str(logits), "-lv", "4"]  # -lv 4: logs n_rot_k
            cmd += ["-f", str(text_file)] if cache == "f16" else ["--kl-divergence"]
            out = _llama_run(cmd)
            m = re.search(r"Final estimate: PPL = ([0-9.]+)", out) or re.search(
                r"Mean PPL\(Q\)\s+:\s+([0-9.]+)", out)
            row = {"cache_type": cache, "ppl": float(m.group(1)) if m else None,
                   "rotation_log": [ln.strip() for ln in out.splitlines()
                                    if "llama_kv_cache: n_rot_" in ln][:2],
                   "command": " ".join(cmd[1:])}
            for key, pattern in LLAMA_KLD.items():
                k = re.search(pattern, out)
                row[key] = float(k.group(1)) if k else None
            if row["top1_agreement"] is not None:
                row["top1_agreement"] /= 100
            rows.append(row)
            print(f"llama.cpp {cache}: PPL {row['ppl']} KLD mean {row['kld_mean']} "
                  f"p99 {row['kld_p99']} max {row['kld_max']} {row['rotation_log']}", flush=True)
    base = rows[0]["ppl"]
    for row in rows:
        row["delta_ppl_pct"] = (100 * (row["ppl"] / base - 1)) if row["ppl"] and base else None
    return {"version": version, "binary": str(binary), "runs": rows}


def capacity(variants, budget_bytes: int, tokens: int, max_num_seqs: int) -> list[dict]:
    """Per variant (and bf16): the effective bits per K/V element of one ``tokens`` request
    (codes, scales, zero points and the bf16 full-precision window included, as
    ``kvledger plan`` counts them), ``kvledger plan``'s concurrency at ``tokens`` on an
    H100-SXM, and requests of ``tokens`` that fit the engine's pool (fp32 compute) in
    ``budget_bytes`` next to the ledger's figure for the same pool."""
    import torch

    from kvledger.engine.config import EngineConfig
    from kvledger.engine.engine import LLMEngine
    from kvledger.ledger.admission import blocks_for_kv_tokens
    from kvledger.ledger.hardware import get_device
    from kvledger.ledger.kv import kv_bytes_per_block, residual_bytes
    from kvledger.ledger.planner import RESIDUAL_FORMAT, PlanOptions, plan
    from kvledger.model.weights.loader import load_weights

    spec, weights = load_weights("default", torch.float32)
    per_request_blocks = blocks_for_kv_tokens(tokens, 16)
    elements = tokens * 2 * spec.num_layers * spec.num_kv_heads * spec.head_dim
    rows = []
    for label, over in [("bf16", {"kv_cache_dtype": "bf16"}), *variants]:
        cfg = EngineConfig(dtype="fp32", kv_cache_gib=budget_bytes / 2**30,
                           max_num_seqs=max_num_seqs, **over)
        engine = LLMEngine(cfg, spec=spec, weights=weights)
        kv, block = cfg.kv_format_spec(), kv_bytes_per_block(spec, cfg.kv_format_spec(), 1, 16)
        reserved = max_num_seqs * residual_bytes(spec, kv, 1, 16, "fp32")
        one = per_request_blocks * block + residual_bytes(spec, kv, 1, 16, RESIDUAL_FORMAT)
        planned = plan(spec, get_device("H100-SXM"), PlanOptions(
            contexts=(tokens,), kv_format=cfg.kv_cache_dtype, kv_key_quant=cfg.kv_key_quant,
            kv_outlier_channels=cfg.kv_outlier_channels or None,
            kv_key_group_tokens=cfg.kv_key_group_tokens,
            kv_residual_tokens=cfg.kv_residual_tokens, kv_intact_tokens=cfg.kv_intact_tokens))
        rows.append({"variant": label, "bits_per_element": round(8 * one / elements, 3),
                     "plan_concurrency_h100": planned.contexts[0].max_concurrency,
                     "pool_blocks": engine.stats()["kv_blocks_total"],
                     "pool_bytes": engine.store.nbytes,
                     "within_budget": engine.store.nbytes <= budget_bytes,
                     "engine_requests": engine.stats()["kv_blocks_total"] // per_request_blocks,
                     "ledger_requests": (budget_bytes - reserved) // (per_request_blocks * block)})
        del engine
    return rows


def _labels(text: str) -> set[str]:
    """The variant labels of ``--only``: separated by ';', or by ',' when every piece is a
    label (labels such as "int4 + rotation, R 128" hold commas)."""
    known = {label for label, _ in PASSKEY_VARIANTS}
    parts = text.split(";" if ";" in text else ",")
    if ";" not in text and not all(p.strip() in known for p in parts):
        parts = [text]
    return {p.strip() for p in parts if p.strip()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--context", type=int, default=2048)
    ap.add_argument("--chunks", type=int, default=4)
    ap.add_argument("--stride", type=int, help="tokens fed per step (default: the engine's prefill chunk)")
    ap.add_argument("--only", help="variant labels separated by ';' (or ',' when no label holds "
                    "one; default: all)")
    ap.add_argument("--text", type=Path, help="UTF-8 text to score (default: the pydoc topics)")
    ap.add_argument("--base", default="fp16", help="KV format of the KLD base (fp32 compute)")
    ap.add_argument("--no-peer", action="store_true", help="skip llama.cpp")
    ap.add_argument("--peer-threads", type=int, default=2, help="llama.cpp's threads (-t)")
    ap.add_argument("--no-capacity", action="store_true", help="skip the capacity rows")
    ap.add_argument("--json", type=Path, help="write every figure here")
    ap.add_argument("--passkey-depths", type=int, default=0, help="pass-key depths (0: none)")
    ap.add_argument("--passkey-trials", type=int, default=1, help="pass keys per depth")
    ap.add_argument("--passkey-seed", type=int, default=0, help="seed of the pass keys")
    ap.add_argument("--passkey-only", action="store_true", help="only the pass-key trials")
    args = ap.parse_args()
    wanted = _labels(args.only) if args.only else None
    unknown = (wanted or set()) - {label for label, _ in PASSKEY_VARIANTS}
    if unknown:
        ap.error(f"unknown variants {sorted(unknown)}; known: "
                 f"{'; '.join(label for label, _ in PASSKEY_VARIANTS)}")
    keys = None
    if args.passkey_depths:
        keys = passkey_accuracy(args.context, args.passkey_depths, [
            v for v in PASSKEY_VARIANTS if wanted is None or v[0] in wanted],
            args.passkey_trials, args.passkey_seed)
    if args.passkey_only:
        if args.json:
            args.json.write_text(json.dumps({"date": str(date.today()), "context": args.context,
                                             "passkey": keys}, indent=1))
        return
    variants = [v for v in VARIANTS if wanted is None or v[0] in wanted]
    print(machine_line(2), flush=True)

    def write(rows, peer=None, cap=()):
        if args.json:
            args.json.write_text(json.dumps({
                "date": str(date.today()), "context": args.context, "machine": machine_line(2),
                "text": str(args.text or "pydoc_data.topics"),
                "base": args.base, "stride": args.stride, "chunks": args.chunks,
                "kvledger": rows, "llama_cpp": peer, "capacity_256MiB_4K": list(cap),
                "passkey": keys}, indent=1))

    rows, text = quality(args.context, args.chunks, variants, args.base, args.stride, write,
                         args.text)
    peer = None if args.no_peer else llama_cpp(text, args.context, args.chunks,
                                               args.peer_threads)
    cap = [] if args.no_capacity else capacity(variants, 256 << 20, 4096, 8)
    for row in cap:
        print(row)
    write(rows, peer, cap)


if __name__ == "__main__":
    main()
