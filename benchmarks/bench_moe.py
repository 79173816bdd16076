"""Routed experts at the shape of Qwen3-30B-A3B (issue 35): batch-1 TPOT against a dense Qwen3
with the same active parameters and against llama.cpp on the same GGUF Q8_0 files.

The full model (48 layers, 31 GB at 8 bits) does not fit the machines here, so both models keep
Qwen3-30B-A3B's config (hidden 2,048, 32 query / 4 KV heads of 128, vocabulary 151,936, an
untied head, 128 experts of 768 with top 8) with ``--layers`` decoder layers (default 2). The
dense model is ``model_type: qwen3`` with ``intermediate_size`` 6,144 = 8 x 768: per layer the
same active MLP parameters (less the router's 262,144).

``prepare`` (not timed): per model, a Hugging Face folder with the shrunk config, kvledger's
dummy weights in bf16 and the bundled tokenizer padded to the vocabulary (``dummy_gguf.py``), converted by llama.cpp's ``convert_hf_to_gguf.py --outtype q8_0``.
``time``: kvledger's TPOT (64 new tokens after a 512-token prompt, greedy, EOS ignored, the
default fast mode: the probe's formats, w8a8 on the file's Q8_0 codes where it picks it) and
the bytes of weights one decode step reads (``decode_weight_bytes``, measured per step as the
experts run: :attr:`kvledger.model.layers.experts.Experts.bytes_read`) beside the ledger's active
parameters; then ``llama-bench`` tg64 at depth 512 on the same file and threads.

Usage:
  python benchmarks/bench_moe.py prepare --work DIR --llama-src SRC [--sentencepiece DIR]
  python benchmarks/bench_moe.py time --work DIR [--threads 2]
"""

from __future__ import annotations

import json
from pathlib import Path

import peer_llamacpp as peer
from common import machine_line, real_text_ids
from dummy_gguf import command_line, dummy_folder

BASE = "Qwen/Qwen3-30B-A3B"
MODELS = ("moe", "dense")


def _config(kind: str, layers: int) -> dict:
    """The shrunk config of ``kind`` (module docstring)."""
    from kvledger.model.catalogue import lookup

    raw = json.loads(Path(lookup(BASE).path).read_text())
    raw.update(num_hidden_layers=layers, max_window_layers=layers)
    if kind == "dense":
        raw.update(model_type="qwen3", architectures=["Qwen3ForCausalLM"],
                   intermediate_size=raw["num_experts_per_tok"] * raw["moe_intermediate_size"])
        for key in ("num_experts", "num_experts_per_tok", "moe_intermediate_size",
                    "decoder_sparse_step", "mlp_only_layers", "norm_topk_prob",
                    "router_aux_loss_coef", "output_router_logits"):
            raw.pop(key)
    return raw


def prepare(args) -> None:
    work = Path(args.work)
    for kind in MODELS:
        folder = dummy_folder(work / f"{kind}-hf", _config(kind, args.layers))
        out = peer.convert_hf_to_gguf(folder, work / f"{kind}-q8_0.gguf", "q8_0",
                                      args.llama_src, args.sentencepiece)
        (folder / "model.safetensors").unlink()  # the GGUF is what both engines run
        print(f"{kind}: {out} ({out.stat().st_size / 1e9:.2f} GB)")


def ours(path: Path, threads: int, prompt: int, new: int) -> dict:
    from kvledger import LLM, SamplingParams
    from kvledger.ledger.params import count_params

    llm = LLM(str(path), enable_prefix_caching=False, num_threads=threads)
    params = SamplingParams(max_tokens=new, temperature=0.0, ignore_eos=True)
    llm.generate([real_text_ids(llm.tokenizer, 64)], params)  # warm-up
    model = llm.engine.model
    experts = getattr(model, "experts", [])
    before = sum(ex.bytes_read for ex in experts)
    out = llm.generate([real_text_ids(llm.tokenizer, prompt)], params)[0]
    spec = llm.engine.spec
    p = count_params(spec)
    return {"formats": model.weight_formats, "attention": model.attention.name,
            "tpot_ms": out.tpot_s * 1e3, "ttft_ms": out.metrics.ttft_s * 1e3,
            "decode_weight_bytes": model.decode_weight_bytes,
            "expert_bytes_per_token": (sum(ex.bytes_read for ex in experts) - before) / (
                prompt + new - 1) if experts else 0,
            "ledger_active": p.active, "ledger_total": p.total,
            "ledger_active_less_embedding": p.active - p.embedding}


def time_models(args) -> None:
    print(machine_line(args.threads))
    for kind in args.models or MODELS:
        path = Path(args.work) / f"{kind}-q8_0.gguf"
        mine = ours(path, args.threads, 512, args.new)
        print(f"{kind} kvledger: formats {mine['formats']}, attention {mine['attention']}")
        print(f"  prompt 512: TTFT {mine['ttft_ms']:.0f} ms, TPOT {mine['tpot_ms']:.2f} ms")
        print(f"  weights read per batch-1 decode step: {mine['decode_weight_bytes'] / 1e6:.1f} MB"
              f"; ledger: active {mine['ledger_active'] / 1e6:.1f} M params "
              f"({mine['ledger_active_less_embedding'] / 1e6:.1f} M less the embedding), "
              f"total {mine['ledger_total'] / 1e6:.1f} M")
        if mine["expert_bytes_per_token"]:
            print(f"  expert + router bytes read per token over the run (prefill rows "
                  f"included): {mine['expert_bytes_per_token'] / 1e6:.2f} MB")
        for line in peer.bench_lines(path, args.threads, 512, args.new, (512,)):
            print(" ", line)


def main() -> None:
    ap, prepare_args, _ = command_line(MODELS, new=64)
    prepare_args.add_argument("--layers", type=int, default=2)
    args = ap.parse_args()
    prepare(args) if args.cmd == "prepare" else time_models(args)


if __name__ == "__main__":
    main()
