"""NVIDIA kvpress (the retention peer) in its own shape: compress a prompt to a KV budget, then
score a continuation against the compressed cache.

Runs in a SEPARATE virtualenv: kvpress 0.5.5 requires transformers < 5.3 and the project's is
5.24 (see BENCHMARKS.md for the setup lines). Nothing of kvledger is imported, so the numbers
are the peer's alone. Same text as ``bench_retention.py`` (pydoc_data.topics joined by blank
lines, the first ``--tokens`` tokens by the GGUF's own tokenizer), same weights (the bundled
GGUF, fp32), same split: the first ``tokens - tail`` tokens are the prompt, compressed by the
press during prefill, to exactly ``budget`` tokens as our policies keep
(``compression_ratio = 1 - (budget + 0.5) / prompt``: kvpress keeps ``int(prompt * (1 -
ratio))``, and ``1 - budget / prompt`` rounds down to budget - 1 at 1,536 / 256); the last
``tail`` tokens are then fed with their original positions (as kvpress's pipeline does) and
every next token after the first is scored, the same targets as ``bench_retention.py``'s
snapkv and scope-``prompt`` rows.

Presses: ``StreamingLLMPress`` (4 sinks + recent), ``SnapKVPress`` (window 32, kernel 7, per KV
head), ``ObservedAttentionPress`` (H2O-like: mean attention each key received in prefill, per
KV head; eager attention). ``none`` = the uncompressed cache.

Usage: python benchmarks/bench_kvpress.py --gguf PATH [--tokens 2048] [--tail 512]
       [--budgets 256,512] [--presses none,streaming,snapkv,observed] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import time
from pathlib import Path

import torch
from common import real_text_ids


class _NoSpecialTokens:
    """The tokenizer encoding without a BOS: transformers 5.2 prepends one to this GGUF's text
    and 5.24 (kvledger's) does not, so the texts would differ by a token."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False)


def make_press(name: str, ratio: float):
    """The kvpress press of ``name`` at ``compression_ratio = ratio`` (None for ``none``)."""
    from kvpress import ObservedAttentionPress, SnapKVPress, StreamingLLMPress

    return {"none": lambda: None,
            "streaming": lambda: StreamingLLMPress(compression_ratio=ratio, n_sink=4),
            "snapkv": lambda: SnapKVPress(compression_ratio=ratio, window_size=32,
                                          kernel_size=7),
            "observed": lambda: ObservedAttentionPress(compression_ratio=ratio)}[name]()


def continuation_nll(model, ids: list[int], prompt_len: int, press) -> tuple[torch.Tensor, int]:
    """NLL [len(ids) - prompt_len - 1] of ``ids[prompt_len + 1:]`` after the prompt's KV was
    compressed by ``press``, and the number of KV entries per layer the prompt left."""
    import contextlib

    from transformers import DynamicCache

    x = torch.tensor([ids])
    cache = DynamicCache()
    with torch.no_grad():
        with press(model) if press is not None else contextlib.nullcontext():
            model.model(input_ids=x[:, :prompt_len], past_key_values=cache)
        kept = cache.get_seq_length()
        pos = torch.arange(prompt_len, len(ids))[None]
        logits = model(input_ids=x[:, prompt_len:], past_key_values=cache,
                       position_ids=pos).logits[0]
    logp = torch.log_softmax(logits[:-1].float(), -1)
    return -logp.gather(1, x[0, prompt_len + 1:, None])[:, 0], kept


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gguf", required=True, help="the bundled GGUF file")
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--tail", type=int, default=512)
    ap.add_argument("--budgets", default="256,512")
    ap.add_argument("--presses", default="none,streaming,snapkv,observed")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    from importlib.metadata import version

    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.set_num_threads(args.threads)
    gguf = Path(args.gguf)
    tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    ids = real_text_ids(_NoSpecialTokens(tok), args.tokens)
    prompt_len = args.tokens - args.tail
    print(f"{platform.processor() or platform.machine()} · {args.threads} threads · torch "
          f"{torch.__version__} · transformers {transformers.__version__} · kvpress "
          f"{version('kvpress')} · prompt "
          f"{prompt_len} + scored {args.tail - 1} · ids[:8] {ids[:8]} sum {sum(ids)}", flush=True)
    models = {}
    rows = []
    for name in args.presses.split(","):
        attn = "eager" if name == "observed" else "sdpa"
        if attn not in models:
            models[attn] = AutoModelForCausalLM.from_pretrained(
                str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32,
                attn_implementation=attn).eval()
        for budget in ([None] if name == "none" else [int(b) for b in args.budgets.split(",")]):
            press = make_press(name, 1 - (budget + 0.5) / prompt_len if budget else 0.0)
            t0 = time.perf_counter()
            nll, kept = continuation_nll(models[attn], ids, prompt_len, press)
            rows.append({"press": name, "budget": budget, "kv_kept": kept,
                         "ppl_tail": math.exp(float(nll.mean())),
                         "seconds": round(time.perf_counter() - t0, 1)})
            print(f"{name:9s} budget {budget or '-':>5} (kept {kept}): PPL of the last "
                  f"{args.tail - 1} = {rows[-1]['ppl_tail']:.3f} ({rows[-1]['seconds']} s)",
                  flush=True)
            if args.json:
                Path(args.json).write_text(json.dumps({"args": vars(args), "ids_sum": sum(ids),
                                                       "results": rows}))


if __name__ == "__main__":
    main()
