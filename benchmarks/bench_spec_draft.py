"""Speculative decoding with a draft model (``draft_model``) at batch 1: what a step accepts
and what it costs, next to llama.cpp's ``--model-draft`` on the same pair.

The pair is the bundled SmolLM2-135M drafting for itself (no smaller model with its tokenizer
is bundled): not a speed-up case, since the draft costs what the target does; it measures the
acceptance (about every proposal at temperature 0) and the cost of a step that drafts ``k``
tokens and verifies them. Greedy, EOS ignored, the code-rewrite prompt of
``bench_spec.py``; the modes take turns run by run. Per mode: output tok/s = (tokens - 1) /
(last token - first token), median of ``--repeat`` runs after a warm-up; tokens per target
step = (tokens - 1) / (tokens - 1 - accepted); seconds per step = the decode time / steps.
With ``$KVLEDGER_LLAMA_CPP_DIR`` (llama-server), the same chat through llama-server without
and with ``--spec-type draft-simple --model-draft`` (its ``timings``: ``predicted_per_second``, ``draft_n``,
``draft_n_accepted``), in the same run.

Usage: python benchmarks/bench_spec_draft.py [--threads 1] [--new 48] [--k 4] [--repeat 2]
"""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path

import httpx
from bench_spec import PROMPTS
from common import machine_line
from peer_llamacpp import Server, binary, skip_reason

from kvledger import LLM, SamplingParams
from kvledger.paths import bundled_model_path

KIND = "code rewrite"


def ours(threads: int, new: int, k: int, repeat: int) -> None:
    params = SamplingParams(max_tokens=new, temperature=0.0, ignore_eos=True)
    modes = {"off": None, f"draft_model k={k}": {"method": "draft_model", "model": "default",
                                                  "num_speculative_tokens": k, "gate": False}}
    llms = {mode: LLM(num_threads=threads, speculative_config=c) for mode, c in modes.items()}
    chat = [{"role": "user", "content": PROMPTS[KIND]}]
    runs = {mode: [] for mode in modes}
    for i in range(repeat + 1):
        for mode, llm in llms.items():
            out = llm.generate([chat], params)[0]
            m = out.metrics
            if i:
                runs[mode].append((len(out.token_ids) - 1, m.spec_accepted_tokens,
                                   m.spec_proposed_tokens, m.last_token_time - m.first_token_time))
    for mode, rows in runs.items():
        n, accepted, proposed, seconds = (statistics.median(col) for col in zip(*rows))
        steps = n - accepted
        print(f"kvledger · {mode:16s}: {n / seconds:6.2f} tok/s, accepted {accepted:.0f}/"
              f"{proposed:.0f}, {n / steps:.2f} tokens per target step, "
              f"{seconds / steps * 1000:.0f} ms per step", flush=True)
    for llm in llms.values():
        llm.close()


def llamacpp(threads: int, new: int, k: int, repeat: int, port: int) -> None:
    if binary("llama-server") is None:
        print(skip_reason("llama-server"))
        return
    model = bundled_model_path()
    body = {"messages": [{"role": "user", "content": PROMPTS[KIND]}], "max_tokens": new,
            "temperature": 0.0, "ignore_eos": True}
    draft = ("--spec-type", "draft-simple", "--model-draft", str(model),
             "--spec-draft-n-max", str(k), "--threads-draft", str(threads))
    for mode, extra in (("off", ()), (f"--model-draft k={k}", draft)):
        with Server(model, port, threads, parallel=1, context=4096, extra=extra) as server:
            rows = []
            for i in range(repeat + 1):
                t = httpx.post(f"{server.url}/v1/chat/completions", json=body,
                               timeout=900).json()["timings"]
                if i:
                    rows.append((t["predicted_per_second"], t.get("draft_n", 0),
                                 t.get("draft_n_accepted", 0), t["predicted_n"]))
            rate, drafted, accepted, n = (statistics.median(col) for col in zip(*rows))
            steps = max(n - accepted, 1)
            print(f"llama.cpp · {mode:16s}: {rate:6.2f} tok/s, accepted {accepted:.0f}/"
                  f"{drafted:.0f}, {n / steps:.2f} tokens per target step, "
                  f"{1000 / rate * n / steps:.0f} ms per step", flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--new", type=int, default=48)
    p.add_argument("--k", type=int, default=4)
    p.add_argument("--repeat", type=int, default=2)
    p.add_argument("--port", type=int, default=18431)
    a = p.parse_args()
    print(machine_line(a.threads), "·", Path("/proc/loadavg").read_text().strip())
    ours(a.threads, a.new, a.k, a.repeat)
    llamacpp(a.threads, a.new, a.k, a.repeat, a.port)
    print("load average after:", Path("/proc/loadavg").read_text().strip())


if __name__ == "__main__":
    main()
