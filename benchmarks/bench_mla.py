"""Multi-head latent attention at the shape of DeepSeek-V2-Lite (issue 36): KV bytes per token
and batch-1 TPOT at 4,096 and 16,384 tokens of context, against the same shape with per-head
K/V and against llama.cpp on a GGUF of the same model.

The full model (27 layers, 31 GB in bf16) does not fit the machines here, so both models keep
DeepSeek-V2-Lite's config (hidden 2,048, 16 heads, kv_lora_rank 512, qk_rope_head_dim 64,
qk_nope_head_dim 128, v_head_dim 128, vocabulary 102,400, 64 experts of 1,408 with top 6 and 2
shared, the first layer dense) with ``--layers`` decoder layers (default 2) and DeepSeek-V2's
``q_lora_rank`` 1,536 (llama.cpp takes a file for V2-Lite's plain ``q_proj`` only at 26 or 27
layers, ``src/models/deepseek2.cpp``'s ``is_lite``). The per-head model
is ``model_type: llama`` with the same hidden size and 16 heads of 128 for K and V (what MLA's
expanded form would cache per head, less the 64 RoPE dims of its keys) and a dense MLP of
``intermediate_size`` 11,264 = (6 + 2) x 1,408, per layer the MoE layer's active MLP width.

``prepare`` (not timed): per model, a Hugging Face folder with the shrunk config, kvledger's
dummy weights in bf16 and the bundled tokenizer padded to the vocabulary; the MLA model also
converted by llama.cpp's ``convert_hf_to_gguf.py`` to bf16 and Q8_0 GGUF files.
``time``: kvledger's KV bytes per token (the ledger's, which the pool holds) and TPOT over
``--new`` greedy tokens after a prompt of each length (bf16, the default fast mode), then
``llama-bench`` tg at the same depths on each GGUF file, same threads.

Usage:
  python benchmarks/bench_mla.py prepare --work DIR --llama-src SRC [--sentencepiece DIR]
  python benchmarks/bench_mla.py time --work DIR [--threads 2] [--contexts 4096 16384]
      [--models mla perhead llama.cpp]
"""

from __future__ import annotations

import json
from pathlib import Path

import peer_llamacpp as peer
from common import machine_line
from dummy_gguf import command_line, dummy_folder

BASE = "deepseek-ai/DeepSeek-V2-Lite"
MODELS = ("mla", "perhead")
GGUF_TYPES = ("bf16", "q8_0")


def _config(kind: str, layers: int) -> dict:
    """The shrunk config of ``kind`` (module docstring)."""
    from kvledger.model.catalogue import lookup

    raw = json.loads(Path(lookup(BASE).path).read_text())
    raw.update(num_hidden_layers=layers, architectures=["DeepseekV2ForCausalLM"],
               q_lora_rank=1536)
    if kind == "perhead":
        width = (raw["num_experts_per_tok"] + raw["n_shared_experts"]) * raw[
            "moe_intermediate_size"]
        raw = {key: raw[key] for key in ("hidden_size", "num_attention_heads", "vocab_size",
                                         "max_position_embeddings", "rms_norm_eps",
                                         "rope_theta", "bos_token_id", "eos_token_id")}
        raw.update(model_type="llama", architectures=["LlamaForCausalLM"],
                   num_hidden_layers=layers, num_key_value_heads=raw["num_attention_heads"],
                   head_dim=128, intermediate_size=width, tie_word_embeddings=False,
                   torch_dtype="bfloat16")
    return raw


def prepare(args) -> None:
    work = Path(args.work)
    for kind in args.models or MODELS:
        dummy_folder(work / f"{kind}-hf", _config(kind, args.layers))
    for outtype in GGUF_TYPES:
        out = peer.convert_hf_to_gguf(work / "mla-hf", work / f"mla-{outtype}.gguf", outtype,
                                      args.llama_src, args.sentencepiece)
        print(f"mla {outtype}: {out} ({out.stat().st_size / 1e9:.2f} GB)")


def ours(folder: Path, threads: int, contexts: list[int], new: int) -> dict:
    import torch

    from kvledger import LLM, SamplingParams

    llm = LLM(str(folder), enable_prefix_caching=False, num_threads=threads, max_num_seqs=1,
              num_blocks=(max(contexts) + new) // 16 + 2)
    params = SamplingParams(max_tokens=new, temperature=0.0, ignore_eos=True)
    llm.generate([list(range(1000, 1064))], params)  # warm-up
    g = torch.Generator().manual_seed(0)
    tpot = {}
    for n in contexts:
        prompt = torch.randint(1000, 40_000, (n,), generator=g).tolist()
        out = llm.generate([prompt], params)[0]
        tpot[n] = (out.tpot_s * 1e3, out.metrics.ttft_s)
    engine = llm.engine
    return {"kv_bytes_per_token": engine.kv_layout.bytes_per_token, "tpot": tpot,
            "attention": engine.model.attention.name, "formats": engine.model.weight_formats,
            "store": type(engine.store).__name__}


def time_models(args) -> None:
    print(machine_line(args.threads))
    print(f"shape: {BASE} with {args.layers} of its 27 layers (stated), bf16 dummy weights; "
          f"TPOT over {args.new} greedy tokens after the context")
    chosen = args.models or [*MODELS, "llama.cpp"]
    for kind in [k for k in chosen if k in MODELS]:
        mine = ours(Path(args.work) / f"{kind}-hf", args.threads, args.contexts, args.new)
        print(f"{kind} kvledger: KV {mine['kv_bytes_per_token']:,} B/token ({mine['store']}), "
              f"attention {mine['attention']}, formats {mine['formats']}")
        for n, (tpot, ttft) in mine["tpot"].items():
            print(f"  context {n}: TPOT {tpot:.2f} ms (prefill {ttft:.1f} s)")
    if "llama.cpp" not in chosen:
        return
    for outtype in GGUF_TYPES:
        path = Path(args.work) / f"mla-{outtype}.gguf"
        for line in peer.bench_lines(path, args.threads, 0, args.new, tuple(args.contexts), 1,
                                     label=f"llama.cpp {outtype}"):
            print(line)


def main() -> None:
    ap, prepare_args, time_args = command_line([*MODELS, "llama.cpp"], new=32)
    prepare_args.add_argument("--models", nargs="*", choices=MODELS)
    for sub in (prepare_args, time_args):
        sub.add_argument("--layers", type=int, default=2)
    time_args.add_argument("--contexts", type=int, nargs="*", default=[4096, 16384])
    args = ap.parse_args()
    prepare(args) if args.cmd == "prepare" else time_models(args)


if __name__ == "__main__":
    main()
