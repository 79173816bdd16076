"""NVIDIA kvpress (the retention peer) in its own shape: compress a prompt to a KV budget, then
score a continuation against the compressed cache, or (``--passkey``) answer a pass key.

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

``--passkey PROMPTS.json``: the pass-key prompts of ``kvledger eval passkey`` (token ids as our
engine runs them, written by ``bench_passkey_retention.py --write-prompts``), each compressed
by the press during its prefill to exactly ``budget`` tokens (the ratio as above with the
prompt's length), then answered greedily for up to ``answer_tokens`` tokens with original
positions, every answer token kept (kvpress's pipeline: the press acts in prefill only); a
trial passes when the decoded answer holds the key, as in ``kvledger.eval.passkey``.

Usage: python benchmarks/bench_kvpress.py --gguf PATH [--tokens 2048] [--tail 512]
       [--budgets 256,512] [--presses none,streaming,snapkv,observed] [--json out.json]
       [--passkey prompts.json [--contexts 4096,8192]]
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


def passkey_answer(model, ids: list[int], press, answer_tokens: int,
                   eos: int | None) -> tuple[list[int], int]:
    """Greedy answer ids (at most ``answer_tokens``, ending at ``eos``) after the prompt
    ``ids`` was prefilled with ``press`` compressing its KV, and the KV entries per layer the
    prompt left."""
    import contextlib

    from transformers import DynamicCache

    cache = DynamicCache()
    with torch.no_grad():
        with press(model) if press is not None else contextlib.nullcontext():
            hidden = model.model(input_ids=torch.tensor([ids]), past_key_values=cache)
        kept = cache.get_seq_length()
        logits = model.lm_head(hidden.last_hidden_state[:, -1])
        answer = []
        while True:
            answer.append(int(logits[0].argmax()))
            if len(answer) == answer_tokens or answer[-1] == eos:
                return answer, kept
            pos = torch.tensor([[len(ids) + len(answer) - 1]])
            logits = model(input_ids=torch.tensor([answer[-1:]]), past_key_values=cache,
                           position_ids=pos).logits[:, -1]


def run_passkey(args, tok, model_for) -> list[dict]:
    """Every press and budget over the prompts of ``args.passkey`` (per context); one row
    per (context, press, budget) with each trial's answer, as ``kvledger eval passkey``."""
    spec = json.loads(Path(args.passkey).read_text())
    contexts = sorted({p["context"] for p in spec["prompts"]})
    if args.contexts:
        contexts = [c for c in map(int, args.contexts.split(",")) if c in contexts]
    rows = []
    for context in contexts:
        prompts = [p for p in spec["prompts"] if p["context"] == context]
        for name in args.presses.split(","):
            for budget in [None] if name == "none" else map(int, args.budgets.split(",")):
                trials, t0 = [], time.perf_counter()
                for p in prompts:
                    ratio = 1 - (budget + 0.5) / len(p["ids"]) if budget else 0.0
                    answer, kept = passkey_answer(model_for(name), p["ids"],
                                                  make_press(name, ratio),
                                                  spec["answer_tokens"], tok.eos_token_id)
                    text = tok.decode(answer, skip_special_tokens=True)
                    trials.append({"depth": p["depth"], "key": p["key"], "answer": text,
                                   "retrieved": p["key"] in text, "kv_kept": kept})
                rows.append({"context": context, "press": name, "budget": budget,
                             "trials": trials,
                             "accuracy": sum(t["retrieved"] for t in trials) / len(trials),
                             "seconds": round(time.perf_counter() - t0, 1)})
                marks = " ".join("Y" if t["retrieved"] else "." for t in trials)
                print(f"{context:6d} {name:9s} {budget or '-':>5} (kept "
                      f"{trials[-1]['kv_kept']}): {marks}  {100 * rows[-1]['accuracy']:.0f} % "
                      f"({rows[-1]['seconds']} s)", flush=True)
                if args.json:
                    Path(args.json).write_text(json.dumps({"args": vars(args), "rows": rows}))
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gguf", required=True, help="the bundled GGUF file")
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--tail", type=int, default=512)
    ap.add_argument("--budgets", default="256,512")
    ap.add_argument("--presses", default="none,streaming,snapkv,observed")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json", default=None)
    ap.add_argument("--passkey", default=None, help="pass-key prompts file (see above)")
    ap.add_argument("--contexts", default=None, help="--passkey: contexts to run (default all)")
    args = ap.parse_args()
    from importlib.metadata import version

    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.set_num_threads(args.threads)
    gguf = Path(args.gguf)
    tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    models = {}

    def model_for(press: str):
        """The fp32 model for ``press`` (eager attention for observed, sdpa else), loaded once."""
        attn = "eager" if press == "observed" else "sdpa"
        if attn not in models:
            models[attn] = AutoModelForCausalLM.from_pretrained(
                str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32,
                attn_implementation=attn).eval()
        return models[attn]

    versions = (f"{platform.processor() or platform.machine()} · {args.threads} threads · torch "
                f"{torch.__version__} · transformers {transformers.__version__} · kvpress "
                f"{version('kvpress')}")
    if args.passkey:
        print(f"{versions} · pass-key prompts {args.passkey}", flush=True)
        run_passkey(args, tok, model_for)
        return
    ids = real_text_ids(_NoSpecialTokens(tok), args.tokens)
    prompt_len = args.tokens - args.tail
    print(f"{versions} · prompt {prompt_len} + scored {args.tail - 1} · ids[:8] {ids[:8]} sum "
          f"{sum(ids)}", flush=True)
    rows = []
    for name in args.presses.split(","):
        for budget in ([None] if name == "none" else [int(b) for b in args.budgets.split(",")]):
            press = make_press(name, 1 - (budget + 0.5) / prompt_len if budget else 0.0)
            t0 = time.perf_counter()
            nll, kept = continuation_nll(model_for(name), ids, prompt_len, press)
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
