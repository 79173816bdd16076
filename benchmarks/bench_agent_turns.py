"""A 20-turn agent conversation on a state model (issue 59): TTFT per turn in kvledger with state
checkpoints, without them (no prefix caching), and in ``llama-server`` with its context
checkpoints, on the same GGUF Q8_0 of random weights at Qwen3.5-0.8B's shape; the prefix hit
rate per turn.

The conversation: a system prompt of ``--system`` tokens, then per turn a user message of
``--turn`` tokens; each request is the whole conversation so far and generates one token (its
TTFT); the next turn appends an assistant reply of ``--turn`` tokens and the next user message.
Token ids are drawn with a fixed seed (random weights: what the text says does not matter,
only that every engine sees the same ids); the replies are fixed, not generated, so the three
runs see the same prompts. kvledger runs in-process (``metrics.ttft_s``,
``metrics.num_cached_tokens``); llama-server with one slot, prompt caching on and its context
checkpoints at their defaults (``--server-args`` adds flags), timed by the request's wall clock (``n_predict`` 1), its
``timings.cache_n`` the tokens it reused. The run without checkpoints is limited to the first
``--baseline-turns`` turns (its prompts are recomputed whole: the others' per-turn work is
the new tokens only). Hit rate: tokens reused / the tokens the previous request had.

``prepare`` (not timed): a Hugging Face folder of the catalogue's Qwen3.5-0.8B text config,
transformers' random initialisation in bf16 and the bundled tokenizer padded to the
vocabulary, converted by llama.cpp's ``convert_hf_to_gguf.py --outtype q8_0 --no-mtp`` (the
random model has no multi-token-prediction layer).

Usage:
  python benchmarks/bench_agent_turns.py prepare --work DIR --llama-src SRC [--sentencepiece DIR]
  python benchmarks/bench_agent_turns.py time --work DIR [--threads 1] [--turns 20]
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import httpx
import peer_llamacpp as peer
from common import machine_line
from dummy_gguf import command_line, padded_tokenizer

MODEL = "Qwen/Qwen3.5-0.8B"
NAME = "qwen3.5-0.8b"
PORT = 8391


def prepare(args) -> None:
    import torch
    from transformers import AutoModelForCausalLM, Qwen3_5TextConfig

    from kvledger.model.catalogue import lookup

    folder = Path(args.work) / f"{NAME}-hf"
    folder.mkdir(parents=True, exist_ok=True)
    text = json.loads(Path(lookup(MODEL).path).read_text())["text_config"]
    config = Qwen3_5TextConfig(**{k: v for k, v in text.items() if k != "model_type"})
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).save_pretrained(folder)
    padded_tokenizer(folder, config.vocab_size)
    out = peer.convert_hf_to_gguf(folder, Path(args.work) / f"{NAME}-q8_0.gguf", "q8_0",
                                  args.llama_src, args.sentencepiece, ("--no-mtp",))
    print(f"{NAME}: {out} ({out.stat().st_size / 1e9:.2f} GB)")


def conversation(system: int, turn: int, turns: int, vocab: int) -> list[list[int]]:
    """The prompt of each turn (module docstring)."""
    import torch

    g = torch.Generator().manual_seed(0)

    def ids(n: int) -> list[int]:
        return torch.randint(100, vocab - 100, (n,), generator=g).tolist()

    history, prompts = ids(system), []
    for _ in range(turns):
        history += ids(turn)
        prompts.append(list(history))
        history += ids(turn)  # the assistant's reply
    return prompts


def ours(path: Path, threads: int, prompts: list[list[int]], caching: bool) -> list[tuple]:
    """(TTFT s, cached tokens) per prompt in kvledger."""
    from kvledger import LLM, SamplingParams

    llm = LLM(str(path), enable_prefix_caching=caching, num_threads=threads, max_num_seqs=1,
              kv_cache_gib=1.0)
    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    rows = []
    for prompt in prompts:
        out = llm.generate([prompt], params)[0]
        rows.append((out.metrics.ttft_s, out.metrics.num_cached_tokens))
        print(f"  kvledger (checkpoints {caching}) turn {len(rows)}: {rows[-1]}", flush=True)
    llm.close()
    return rows


def llama_server(path: Path, threads: int, prompts: list[list[int]], log: Path,
                 extra: tuple[str, ...]) -> list[tuple]:
    """(request wall s, cached tokens) per prompt in llama-server (one slot; ``extra``: more
    command-line words)."""
    rows = []
    with peer.Server(path, PORT, threads, parallel=1, context=len(prompts[-1]) + 256,
                     log=log, extra=extra) as server:
        for prompt in prompts:
            start = time.perf_counter()
            r = httpx.post(f"{server.url}/completion", timeout=3600, json={
                "prompt": prompt, "n_predict": 1, "cache_prompt": True, "temperature": 0})
            r.raise_for_status()
            rows.append((time.perf_counter() - start, int(r.json()["timings"]["cache_n"])))
            print(f"  llama-server turn {len(rows)}: {rows[-1]}", flush=True)
    return rows


def time_model(args) -> None:
    print(machine_line(args.threads), "· load", " ".join(f"{x:.1f}" for x in os.getloadavg()))
    from kvledger.model.families import load_spec

    path = Path(args.work) / f"{NAME}-q8_0.gguf"
    prompts = conversation(args.system, args.turn, args.turns, load_spec(path).vocab_size)
    with_cp = ours(path, args.threads, prompts, caching=True)
    without = ours(path, args.threads, prompts[:args.baseline_turns], caching=False)
    peer_rows = llama_server(path, args.threads, prompts, Path(args.work) / "server.log",
                             tuple(args.server_args.split()))
    print("turn | prompt | kvledger ckpt TTFT s (hit %) | no ckpt TTFT s | llama-server s (hit %)")
    for t, prompt in enumerate(prompts):
        before = len(prompts[t - 1]) if t else 0

        def pct(cached: int, before: int = before) -> str:
            return f"{100 * cached / before:.0f} %" if before else "-"
        base = f"{without[t][0]:.2f}" if t < len(without) else "-"
        print(f"{t + 1} | {len(prompt)} | {with_cp[t][0]:.2f} ({pct(with_cp[t][1])}) | {base} | "
              f"{peer_rows[t][0]:.2f} ({pct(peer_rows[t][1])})")
    rest = slice(1, None)
    ours_s, peer_s = sum(r[0] for r in with_cp[rest]), sum(r[0] for r in peer_rows[rest])
    print(f"turns 2-{len(prompts)}: kvledger {ours_s:.1f} s, llama-server {peer_s:.1f} s: "
          f"{ours_s / peer_s:.2f}x")
    print("load after:", " ".join(f"{x:.1f}" for x in os.getloadavg()))


def main() -> None:
    ap, _, time_parser = command_line([NAME], new=1)
    time_parser.add_argument("--system", type=int, default=2000)
    time_parser.add_argument("--turn", type=int, default=100)
    time_parser.add_argument("--turns", type=int, default=20)
    time_parser.add_argument("--baseline-turns", type=int, default=3)
    time_parser.add_argument("--server-args", default="",
                             help="more llama-server words, e.g. '--checkpoint-min-step 0'")
    args = ap.parse_args()
    prepare(args) if args.cmd == "prepare" else time_model(args)


if __name__ == "__main__":
    main()
