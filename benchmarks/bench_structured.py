"""Structured output on the bundled model: decode cost, schema compile time, and what the grammar
buys a small model (issue 40).

- ``--tpot`` (timing: run alone): TPOT with a JSON-schema constraint against without, at batch 1
  and 16. Each request asks for a 30-item JSON list (longer than ``--new`` tokens, so every
  constrained request decodes all ``--new`` steps); unconstrained requests get the same prompts
  with EOS ignored. Only engine steps in which every request decodes are timed (as in
  ``bench_kv_tpot.py``); TPOT = the median step, then the median over ``--repeats`` runs,
  constrained and free runs interleaved. ``--free-only`` runs the unconstrained half alone,
  so the same command on the commit before (``PYTHONPATH`` = its tree) says whether requests
  without a grammar pay anything.
- ``--compile`` (timing): the grammar compiler's tokenizer build, then each schema of
  ``data/structured_prompts.json`` compiled first (matcher construction, and its first mask),
  and again from the cache.
- ``--validity``: the 50 prompts of ``data/structured_prompts.json``, each paired with a
  schema the system message spells out, greedy, with and without the constraint; a reply
  counts as valid when ``json.loads`` of it validates with ``jsonschema``, and leniently
  valid when the first ``{...}`` span in it does (what a client that hunts for JSON gets).

    python benchmarks/bench_structured.py --tpot [--new 48] [--repeats 3] [--free-only]
    python benchmarks/bench_structured.py --compile
    python benchmarks/bench_structured.py --validity [--max-tokens 300]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch
from common import decode_step_times, machine_line

DATA = Path(__file__).parent / "data" / "structured_prompts.json"
LIST = {"type": "array", "minItems": 30, "maxItems": 30, "items": {
    "type": "object", "additionalProperties": False, "required": ["id", "name"],
    "properties": {"id": {"type": "integer", "minimum": 0, "maximum": 999},
                   "name": {"type": "string", "minLength": 1, "maxLength": 16}}}}
FRUITS = ["apples", "pears", "plums", "cherries", "grapes", "lemons", "limes", "figs",
          "dates", "melons", "kiwis", "mangoes", "peaches", "oranges", "berries", "olives"]


def _engine(threads: int):
    from kvledger.engine.config import EngineConfig
    from kvledger.engine.engine import LLMEngine

    return LLMEngine(EngineConfig(dtype="bf16", num_threads=threads))


def tpot(args) -> None:
    from kvledger.engine.sample.sampling_params import SamplingParams

    engine = _engine(args.threads)
    print(machine_line(args.threads), "· bf16 · new", args.new, "· repeats", args.repeats)
    modes = ["free"] if args.free_only else ["free", "json_schema"]
    for batch in (1, 16):
        prompts = [[{"role": "user", "content": f"List 30 {FRUITS[i]} dishes as JSON: id "
                                                 "and name."}] for i in range(batch)]
        params = {"free": SamplingParams(max_tokens=args.new, temperature=0.0, ignore_eos=True)}
        if not args.free_only:
            params["json_schema"] = SamplingParams(max_tokens=args.new, temperature=0.0,
                                                   structured_outputs={"json": LIST})
        decode_step_times(engine, prompts[:1], [params[modes[-1]]])  # warm: compile, caches
        runs = {m: [] for m in modes}
        for _ in range(args.repeats):
            for mode in modes:
                steps = decode_step_times(engine, prompts, [params[mode]] * batch)
                runs[mode].append(statistics.median(steps))
        free = statistics.median(runs["free"])
        for mode in modes:
            t = statistics.median(runs[mode])
            print(f"batch {batch:2d} {mode:11s} TPOT {t * 1e3:7.2f} ms ({t / free:.3f}x free)"
                  f"  runs {[round(r * 1e3, 2) for r in runs[mode]]}", flush=True)


def compile_times(args) -> None:
    from kvledger.engine.sample.structured.compiler import GrammarCompiler
    from kvledger.engine.sample.structured.constraint import StructuredOutputsParams
    from kvledger.engine.sample.structured.masks import apply_grammar_masks
    from kvledger.model.weights.loader import load_tokenizer

    tokenizer = load_tokenizer("default")
    compiler = GrammarCompiler(tokenizer, len(tokenizer), [tokenizer.eos_token_id])
    print(machine_line(args.threads))
    t0 = time.perf_counter()
    compiler.matcher(StructuredOutputsParams(regex="a"))
    print(f"tokenizer build (once per engine): {time.perf_counter() - t0:.2f} s")
    schemas = {json.dumps(i["schema"], sort_keys=True): i["id"].split("-")[0]
               for i in json.loads(DATA.read_text())}
    first, mask, cached = [], [], []
    for text, name in schemas.items():
        constraint = StructuredOutputsParams(json=json.loads(text))
        t0 = time.perf_counter()
        matcher = compiler.matcher(constraint)
        t1 = time.perf_counter()
        request = type("R", (), {"grammar": matcher})()
        apply_grammar_masks(torch.zeros(1, len(tokenizer)), [request], compiler)
        t2 = time.perf_counter()
        compiler.matcher(constraint)
        t3 = time.perf_counter()
        first.append((t1 - t0) * 1e3)
        mask.append((t2 - t1) * 1e3)
        cached.append((t3 - t2) * 1e3)
        print(f"{name:10s} compile {first[-1]:6.2f} ms, first mask {mask[-1]:6.2f} ms, "
              f"cached {cached[-1]:.3f} ms")
    print(f"median of {len(first)} schemas: compile {statistics.median(first):.2f} ms first, "
          f"first mask {statistics.median(mask):.2f} ms, cached {statistics.median(cached):.3f}"
          " ms")


def _lenient(text: str):
    start, end = text.find("{"), text.rfind("}")
    return json.loads(text[start:end + 1]) if 0 <= start < end else None


def validity(args) -> None:
    import jsonschema

    from kvledger.engine.sample.sampling_params import SamplingParams

    items = json.loads(DATA.read_text())
    engine = _engine(args.threads)
    prompts = [[{"role": "system", "content": "Reply with one JSON object only, matching this "
                 f"JSON schema: {json.dumps(i['schema'])}"},
                {"role": "user", "content": i["prompt"]}] for i in items]
    print(machine_line(args.threads), f"· {len(items)} prompts · greedy · max_tokens "
          f"{args.max_tokens}")
    for mode in ("free", "json_schema"):
        params = [SamplingParams(max_tokens=args.max_tokens, temperature=0.0,
                                 structured_outputs={"json": i["schema"]}
                                 if mode == "json_schema" else None) for i in items]
        finals = {}
        for i, (prompt, p) in enumerate(zip(prompts, params)):
            engine.add_request(f"{mode}-{i}", prompt, p)
        while engine.has_unfinished_requests():
            finals.update((o.request_id, o) for o in engine.step() if o.finished)
        strict = lenient = stopped = 0
        cut = []
        for i, item in enumerate(items):
            out = finals[f"{mode}-{i}"]
            stopped += out.finish_reason == "stop"
            if out.finish_reason != "stop":
                cut.append(item["id"])
            for parse, counter in ((json.loads, "strict"), (_lenient, "lenient")):
                try:
                    value = parse(out.text)
                    ok = value is not None and jsonschema.Draft202012Validator(
                        item["schema"]).is_valid(value)
                except ValueError:
                    ok = False
                if counter == "strict":
                    strict += ok
                else:
                    lenient += ok
        n = len(items)
        print(f"{mode:11s} valid {strict}/{n} ({strict / n:.0%}), leniently valid "
              f"{lenient}/{n} ({lenient / n:.0%}), finish stop {stopped}/{n}; cut by "
              f"max_tokens: {', '.join(cut[:10]) or 'none'}", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    mode = ap.add_mutually_exclusive_group(required=True)
    mode.add_argument("--tpot", action="store_true")
    mode.add_argument("--compile", action="store_true")
    mode.add_argument("--validity", action="store_true")
    ap.add_argument("--new", type=int, default=48, help="decode steps per request (--tpot)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--free-only", action="store_true", help="--tpot without constraints")
    ap.add_argument("--max-tokens", type=int, default=300, help="--validity reply budget")
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    if args.tpot:
        tpot(args)
    elif args.compile:
        compile_times(args)
    else:
        validity(args)


if __name__ == "__main__":
    main()
