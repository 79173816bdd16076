"""What each KV format costs in quality and buys in capacity, on the bundled model.

Quality: ``kvledger eval perplexity``'s protocol (llama.cpp's: non-overlapping chunks of
``--context`` tokens, second half scored, whole chunk in one prefill) on Python's
``pydoc_data.topics`` text, for fp8 / int8 / int4 (per-channel and per-token keys, with and
without fp16 outlier channels), each against a bf16-KV base run in lockstep: ΔPPL and mean KL
divergence, top-1 agreement. fp32 compute. Accuracy figures do not depend on machine load.

Peer (same text file, same GGUF): ``llama-perplexity`` with ``-ctk/-ctv`` f16, q8_0, q4_0 when
``$KVLEDGER_LLAMA_CPP_DIR`` names a folder holding it (skipped otherwise).

Capacity: 4K-token requests that fit in a 256 MiB KV budget per format: the engine's pool
(blocks after the residual buffers) / blocks per request, next to the ledger's figure.

Pass key (``--passkey-depths N``, alone with ``--passkey-only``): ``kvledger eval passkey``'s
trial (a 5-digit key hidden in filler, asked for at the end, greedy answer) at ``--context``
for N depths evenly spread over [0, 1], per KV format, bf16 compute (the default mode). The depths run deepest first, so each
prompt finds the filler before its key in the prefix cache (the answers do not change: cold
and warm runs give the same tokens).

    python benchmarks/bench_kv_quality.py [--context 2048] [--chunks 4] [--json OUT]
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

VARIANTS = [  # label, EngineConfig overrides
    ("fp8", {"kv_cache_dtype": "fp8"}),
    ("int8", {"kv_cache_dtype": "int8"}),
    ("int8 per-token keys", {"kv_cache_dtype": "int8", "kv_key_quant": "per-token"}),
    ("int4", {"kv_cache_dtype": "int4"}),
    ("int4 per-token keys", {"kv_cache_dtype": "int4", "kv_key_quant": "per-token"}),
    ("int4 + 4 outliers", {"kv_cache_dtype": "int4", "kv_outlier_channels": 4}),
    ("int4 per-token keys + 4 outliers",
     {"kv_cache_dtype": "int4", "kv_key_quant": "per-token", "kv_outlier_channels": 4}),
]
LLAMA_CACHE_TYPES = ("f16", "q8_0", "q4_0")
PASSKEY_VARIANTS = [("bf16", {"kv_cache_dtype": "bf16"}), *(
    v for v in VARIANTS if v[0] in ("fp8", "int8", "int4", "int4 + 4 outliers"))]


def quality(context: int, chunks: int, variants) -> tuple[list[dict], str]:
    import torch

    from kvledger.engine.config import EngineConfig
    from kvledger.engine.engine import LLMEngine
    from kvledger.eval.corpus import default_text
    from kvledger.eval.perplexity import perplexity
    from kvledger.eval.scoring import eval_config
    from kvledger.model.weights.loader import load_tokenizer, load_weights

    spec, weights = load_weights("default", torch.float32)
    tokenizer = load_tokenizer("default")
    text = default_text()
    ids = tokenizer.encode(text, add_special_tokens=False)
    base_cfg = eval_config(EngineConfig(dtype="fp32", kv_cache_dtype="bf16"), context)
    base = LLMEngine(base_cfg, spec=spec, weights=weights, tokenizer=tokenizer)
    rows = []
    for label, over in variants:
        t0 = time.perf_counter()
        engine = LLMEngine(dataclasses.replace(base_cfg, **over), spec=spec, weights=weights,
                           tokenizer=tokenizer)
        r = perplexity(engine, ids, context, max_chunks=chunks, base=base)
        rows.append({"variant": label, "layout": engine.kv_layout.describe(),
                     "bytes_per_token": engine.bytes_per_token, **r.to_json(),
                     "seconds": round(time.perf_counter() - t0, 1)})
        print(f"{label:34s} ppl {r.ppl:.4f} base {r.ppl_base:.4f} "
              f"dppl {r.delta_ppl_pct:+.3f}% kld {r.kld_mean:.5f} top1 {r.top1_agreement:.4f}",
              flush=True)
        del engine
    return rows, text


def passkey_accuracy(context: int, depths: int) -> list[dict]:
    """Pass-key trials at ``depths`` evenly spread depths per format of PASSKEY_VARIANTS, in
    the default mode (bf16 compute, every format read by the native kernel; with fp32
    compute a bf16 pool falls back to the PyTorch backend, ~10x slower at 4K)."""
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
    for label, over in PASSKEY_VARIANTS:
        cfg = eval_config(EngineConfig(dtype="bf16", **over), context)
        engine = LLMEngine(cfg, spec=spec, weights=weights, tokenizer=tokenizer)
        r = passkey(engine, context, at)
        rows.append({"variant": label, **r.to_json()})
        print(f"passkey {label:20s} {100 * r.accuracy:5.1f} % "
              f"({sum(t.retrieved for t in r.trials)}/{len(r.trials)}); missed at "
              f"{[t.depth for t in r.trials if not t.retrieved]}", flush=True)
        del engine
    return rows


def llama_cpp(text: str, context: int, chunks: int) -> list[dict] | None:
    """llama-perplexity per KV cache type on the same text, or None without the binary."""
    folder = os.environ.get("KVLEDGER_LLAMA_CPP_DIR")
    binary = Path(folder or "/nonexistent") / "llama-perplexity"
    if not binary.is_file():
        print("llama.cpp: skipped (set KVLEDGER_LLAMA_CPP_DIR to a folder with llama-perplexity)")
        return None
    from kvledger.paths import bundled_model_path

    rows = []
    with tempfile.NamedTemporaryFile("w", suffix=".txt", delete=False) as f:
        f.write(text)
    for cache in LLAMA_CACHE_TYPES:
        cmd = [str(binary), "-m", str(bundled_model_path()), "-f", f.name, "-c", str(context),
               "--chunks", str(chunks), "-t", "2", "-fa", "on", "-ctk", cache, "-ctv", cache]
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=3600, check=False)
        m = re.search(r"Final estimate: PPL = ([0-9.]+)", done.stdout + done.stderr)
        ppl = float(m.group(1)) if m else None
        rows.append({"cache_type": cache, "ppl": ppl, "command": " ".join(cmd[1:])})
        print(f"llama.cpp {cache}: PPL {ppl}", flush=True)
    base = rows[0]["ppl"]
    for row in rows:
        row["delta_ppl_pct"] = (100 * (row["ppl"] / base - 1)) if row["ppl"] and base else None
    os.unlink(f.name)
    return rows


def capacity(budget_bytes: int, tokens: int, max_num_seqs: int) -> list[dict]:
    """Requests of ``tokens`` that fit the engine's pool vs the ledger's figure, per format."""
    import torch

    from kvledger.engine.config import EngineConfig
    from kvledger.engine.engine import LLMEngine
    from kvledger.ledger.admission import blocks_for_kv_tokens
    from kvledger.ledger.kv import kv_bytes_per_block, residual_bytes
    from kvledger.model.weights.loader import load_weights

    spec, weights = load_weights("default", torch.float32)
    per_request_blocks = blocks_for_kv_tokens(tokens, 16)
    rows = []
    for fmt in ("fp32", "bf16", "fp8", "int8", "int4"):
        cfg = EngineConfig(dtype="fp32", kv_cache_dtype=fmt, kv_cache_gib=budget_bytes / 2**30,
                           max_num_seqs=max_num_seqs)
        engine = LLMEngine(cfg, spec=spec, weights=weights)
        fits = engine.store.nbytes <= budget_bytes
        kv = cfg.kv_format_spec()
        reserved = max_num_seqs * residual_bytes(spec, kv, 1, 16, "fp32")
        ledger = (budget_bytes - reserved) // (per_request_blocks * kv_bytes_per_block(
            spec, kv, 1, 16))
        rows.append({"kv_format": fmt, "pool_blocks": engine.stats()["kv_blocks_total"],
                     "pool_bytes": engine.store.nbytes, "within_budget": fits,
                     "engine_requests": engine.stats()["kv_blocks_total"] // per_request_blocks,
                     "ledger_requests": ledger})
        del engine
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--context", type=int, default=2048)
    ap.add_argument("--chunks", type=int, default=4)
    ap.add_argument("--only", help="comma-separated variant labels (default: all)")
    ap.add_argument("--json", type=Path, help="write every figure here")
    ap.add_argument("--passkey-depths", type=int, default=0, help="pass-key depths (0: none)")
    ap.add_argument("--passkey-only", action="store_true", help="only the pass-key trials")
    args = ap.parse_args()
    keys = passkey_accuracy(args.context, args.passkey_depths) if args.passkey_depths else None
    if args.passkey_only:
        if args.json:
            args.json.write_text(json.dumps({"date": str(date.today()), "context": args.context,
                                             "passkey": keys}, indent=1))
        return
    variants = VARIANTS
    if args.only:
        wanted = set(args.only.split(","))
        variants = [v for v in VARIANTS if v[0] in wanted]
    rows, text = quality(args.context, args.chunks, variants)
    peer = llama_cpp(text, args.context, args.chunks)
    cap = capacity(256 << 20, 4096, 8)
    for row in cap:
        print(row)
    if args.json:
        args.json.write_text(json.dumps({"date": str(date.today()), "context": args.context,
                                         "chunks": args.chunks, "kvledger": rows,
                                         "llama_cpp": peer, "capacity_256MiB_4K": cap,
                                         "passkey": keys},
                                        indent=1))


if __name__ == "__main__":
    main()
