"""Retention policies on real text: perplexity under a KV budget, and per-position curves.

Text: pydoc_data.topics (Python's own docs, shipped with CPython) concatenated, tokenized by
the bundled model's tokenizer, cut into chunks of ``--chunk`` tokens (the model's context,
8192, by default), each scored from scratch. Teacher forcing through the engine itself: the
chunk is the prompt, fed in steps (h2o, and sinks at ``cache`` positions: ``--stride`` tokens,
eviction between steps, as in generation; full, window, snapkv and sinks at ``original``
positions: ``--exact-stride``, since their numbers do not depend on it: window/sinks masks are
per query, tested in tests/engine/test_retention.py, and a window's cache positions are its
original ones; sinks' cache positions are assigned per step, engine/retention/state.py), and
every position's logits are scored. No step crosses snapkv's prompt boundary.

- ``full``, ``window``, ``sinks``, ``h2o`` at each budget (window/sinks: budget = sinks +
  window, 4 sinks for sinks; h2o: 4 sinks + budget/2 recent + heavy hitters): NLL of every
  position; PPL over the chunk and over its last ``--tail`` tokens.
- ``snapkv``: the first ``chunk - tail`` tokens are the prompt, compressed to the budget when
  prefilled; the last ``tail`` tokens are then scored against the compressed cache (query
  agnostic, as kvpress evaluates). Compared with every policy's PPL on the same tail tokens.
- ``--scope prompt`` (with or instead of ``always``): window, sinks and h2o in kvpress's
  shape, like snapkv: the first ``chunk - tail`` tokens are the prompt, compressed once when
  prefilled (``RetentionSpec.scope``), then the tail is scored keeping every token.
  ``--h2o-scores sum,mean`` runs h2o with each ranking (``RetentionSpec.h2o_scores``);
  ``--h2o-sinks 0 --h2o-window 1`` comes closest to kvpress's ObservedAttentionPress (it
  protects no token; our h2o always keeps its newest one).

Streaming (``--stream sinks,window``): the whole ``--tokens`` text as ONE sequence through each
listed policy at each budget and each of ``--positions`` (original: kept keys where they were
computed; cache: StreamingLLM's positions inside the cache), past the model's trained context,
fed in steps of ``--stream-stride`` tokens (cache positions depend on it: a step's queries sit
after the tokens held at its start), PPL per ``--segment``-token segment next to ``full``'s
chunked figure for the same tokens (every chunk scored from scratch; ``--full-json`` takes it
from an earlier run's JSON).

Usage: python benchmarks/bench_retention.py [--tokens 16384] [--chunk 8192] [--stride 32]
       [--budgets 256,512,1024] [--plot ppl.png] [--json out.json]
       [--stream sinks,window --positions original,cache --stream-stride 32
        --stream-plot stream.png [--full-json full.json]]
"""

from __future__ import annotations

import argparse
import json
import math
import time
from dataclasses import dataclass, replace

import torch
from common import machine_line, real_text_ids

from kvledger import LLM, SamplingParams
from kvledger.engine.request import Request
from kvledger.ledger.retention import DEFAULT_SELECT, SELECTIONS, RetentionSpec


def specs(budgets: list[int], selects: tuple[str, ...] = (DEFAULT_SELECT,),
          scopes: tuple[str, ...] = ("always",), h2o_scores: tuple[str, ...] = ("sum",),
          h2o_sinks: int = 4, h2o_window: int | None = None
          ) -> list[tuple[str, int | None, RetentionSpec]]:
    """(policy, budget, spec) runs; h2o and snapkv once per token selection in ``selects``,
    window/sinks/h2o once per scope in ``scopes``, h2o once per ranking in ``h2o_scores``
    (``h2o_sinks`` sinks and ``h2o_window`` recent tokens, None = budget // 2)."""
    out = [("full", None, RetentionSpec())]
    for b in budgets:
        for scope in scopes:
            out += [("window", b, RetentionSpec("window", window=b, scope=scope)),
                    ("sinks", b, RetentionSpec("sinks", window=b - 4, sinks=4, scope=scope))]
            out += [("h2o", b, RetentionSpec("h2o", budget=b, sinks=h2o_sinks,
                                             window=h2o_window or b // 2, select=s,
                                             scope=scope, h2o_scores=h))
                    for s in selects for h in h2o_scores]
        out += [("snapkv", b, RetentionSpec("snapkv", budget=b, select=s)) for s in selects]
    return out


@dataclass
class _Chunk:
    request: Request
    num_new_tokens: int


def score(engine, ids: list[int], spec: RetentionSpec, stride: int,
          prompt_len: int | None = None) -> torch.Tensor:
    """NLL [len(ids) - 1] of each next token through the engine's cache path (as
    ``kvledger.eval.scoring`` feeds a chunk: allocate, run, then the policy evicts). With
    ``prompt_len`` the request's prompt is ``ids[:prompt_len]`` (snapkv compresses it once it
    is in) and only the later tokens are scored (nan elsewhere)."""
    prompt_len = prompt_len or len(ids)
    req = Request("bench", ids[:prompt_len], SamplingParams(max_tokens=1))
    req.output_token_ids = list(ids[prompt_len:])
    req.retention = engine.retention_state(spec)
    kv, nll = engine.scheduler.kv, torch.full((len(ids) - 1,), math.nan)
    try:
        for start, n in steps(len(ids), stride, prompt_len):
            assert kv.allocate_slots(req, n), "the pool cannot hold the chunk"
            hidden = engine.runner.hidden_states([_Chunk(req, n)])
            req.num_computed_tokens += n
            req.retention.append(start, n)
            kv.retain(req)
            if start + n <= prompt_len < len(ids):
                continue  # snapkv: only the continuation after the compression is scored
            targets = torch.tensor(ids[start + 1: start + n + 1])
            logp = torch.log_softmax(engine.model.compute_logits(hidden[: len(targets)]), -1)
            nll[start: start + len(targets)] = -logp.gather(1, targets[:, None])[:, 0]
    finally:
        kv.free(req)
    return nll


def steps(length: int, stride: int, prompt_len: int) -> list[tuple[int, int]]:
    """(start, tokens) of each step over ``length`` tokens: ``stride`` tokens at a time, none
    crossing ``prompt_len`` (the prompt is all in, and snapkv compresses it, before any later
    token is computed)."""
    return [(start, min(stride, end - start)) for lo, end in ((0, prompt_len), (prompt_len, length))
            for start in range(lo, end, stride)]


def step_dependent(spec: RetentionSpec) -> bool:
    """Whether the spec's NLL depend on the step size: h2o (eviction between steps) and sinks
    at cache positions (the sinks turn by the tokens dropped before the step)."""
    if spec.compresses_prompt:
        return False  # the prompt is prefilled in full whatever the step; then nothing drops
    return spec.policy == "h2o" or (spec.policy == "sinks" and spec.positions == "cache")


def ppl(nll: torch.Tensor) -> float:
    ok = ~torch.isnan(nll)
    return math.exp(float(nll[ok].mean()))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=16384)
    ap.add_argument("--chunk", type=int, default=8192)
    ap.add_argument("--stride", type=int, default=32,
                    help="step of h2o and cache-position sinks (eviction between steps)")
    ap.add_argument("--exact-stride", type=int, default=512,
                    help="step of the runs whose numbers do not depend on it (not h2o, not cache-position sinks)")
    ap.add_argument("--tail", type=int, default=2048)
    ap.add_argument("--budgets", default="256,512,1024")
    ap.add_argument("--policies", default="full,window,sinks,h2o,snapkv")
    ap.add_argument("--select", default=DEFAULT_SELECT,
                    help=f"h2o/snapkv token selections to run, comma-separated ({', '.join(SELECTIONS)})")
    ap.add_argument("--scope", default="always",
                    help="window/sinks/h2o scopes to run, comma-separated (always, prompt)")
    ap.add_argument("--h2o-scores", default="sum",
                    help="h2o rankings to run, comma-separated (sum, mean)")
    ap.add_argument("--h2o-sinks", type=int, default=4)
    ap.add_argument("--h2o-window", type=int, default=None, help="h2o recent tokens (budget // 2)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--plot", default=None)
    ap.add_argument("--json", default=None)
    ap.add_argument("--stream", default=None,
                    help="policies (window,sinks,h2o) to run over the whole text as one stream")
    ap.add_argument("--segment", type=int, default=1024, help="stream PPL segment, tokens")
    ap.add_argument("--stream-plot", default=None)
    ap.add_argument("--positions", default="original,cache",
                    help="stream runs: kv positions to run (original, cache or both)")
    ap.add_argument("--stream-stride", type=int, default=32, help="stream step, tokens")
    ap.add_argument("--full-json", default=None,
                    help="take full's chunked NLL from this earlier --json output")
    args = ap.parse_args()
    budgets = [int(b) for b in args.budgets.split(",")]
    wanted = set(args.policies.split(","))
    llm = LLM("default", dtype="fp32", num_threads=args.threads, max_num_seqs=1)
    engine = llm.engine
    ids = real_text_ids(engine.tokenizer, args.tokens)
    chunks = [ids[i: i + args.chunk] for i in range(0, len(ids) - args.chunk + 1, args.chunk)]
    print(machine_line(args.threads))
    print(f"{len(chunks)} chunks of {args.chunk} tokens (pydoc_data.topics), stride "
          f"{args.stride} (h2o, cache-position sinks), else {args.exact_stride}, tail {args.tail}")
    results = []
    order = args.policies.split(",")
    selects = tuple(args.select.split(","))
    scopes, h2o_scores = tuple(args.scope.split(",")), tuple(args.h2o_scores.split(","))
    runs = sorted((r for r in specs(budgets, selects, scopes, h2o_scores, args.h2o_sinks,
                                    args.h2o_window) if r[0] in wanted),
                  key=lambda r: order.index(r[0]))
    for name, budget, spec in runs:
        t0 = time.perf_counter()
        stride = args.stride if step_dependent(spec) else args.exact_stride
        prompt_len = args.chunk - args.tail if spec.compresses_prompt else None
        nlls = []
        for i, c in enumerate(chunks):
            nlls.append(score(engine, c, spec, stride, prompt_len))
            print(f"  {spec.describe()} chunk {i}: {time.perf_counter() - t0:.0f} s", flush=True)
        nlls = torch.stack(nlls)
        row = {"policy": name, "budget": budget, "spec": spec.describe(),
               "ppl": None if spec.compresses_prompt else ppl(nlls),
               "ppl_tail": ppl(nlls[:, -(args.tail - 1):]),
               "nll_by_position": torch.nanmean(nlls, 0).tolist(),
               "nll_per_chunk": nlls.tolist(),
               "seconds": round(time.perf_counter() - t0, 1)}
        row.update(select=spec.select, scope=spec.scope, h2o_scores=spec.h2o_scores)
        results.append(row)
        label = f"{name} {spec.scope or ''} {spec.h2o_scores or ''}"
        print(f"{label:18s} {spec.select or '':12s} budget {budget or '-':>5}: PPL {row['ppl'] or float('nan'):8.3f}  "
              f"last {args.tail}: {row['ppl_tail']:8.3f}  ({row['seconds']} s)", flush=True)
        save(args, results)
    if args.plot:
        plot(results, args.plot, args.chunk)
    if args.stream:
        stream(engine, ids, args, budgets, results)


def save(args, results: list[dict]) -> None:
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "results": results}, f)


def segment_ppl(nll: torch.Tensor, segment: int) -> list[float]:
    """PPL of each ``segment``-token stretch of a flat NLL vector (nan entries skipped)."""
    return [ppl(nll[lo: lo + segment]) for lo in range(0, len(nll), segment)]


def stream(engine, ids: list[int], args, budgets: list[int], results: list[dict]) -> None:
    """The whole text as one sequence through each ``--stream`` policy (one row each), and
    ``full``'s chunked NLL laid end to end for the same tokens (when it ran)."""
    earlier = results
    if args.full_json:
        with open(args.full_json) as f:
            earlier = json.load(f)["results"]
    full = next((r for r in earlier if r["policy"] == "full"), None)
    rows = []
    if full is not None:
        flat = torch.cat([torch.tensor(c + [math.nan]) for c in full["nll_per_chunk"]])
        rows.append({"policy": "full (chunked)", "budget": None,
                     "segments": segment_ppl(flat, args.segment), "ppl": full["ppl"]})
    runs = [(name, budget, replace(spec, positions=p)) for name in args.stream.split(",")
            for name_, budget, spec in specs(budgets) if name_ == name
            for p in args.positions.split(",")]
    for name, budget, spec in runs:
        t0 = time.perf_counter()
        nll = score(engine, ids, spec, args.stream_stride)
        rows.append({"policy": f"{name} {spec.positions} (one stream)", "budget": budget,
                     "spec": spec.describe(), "segments": segment_ppl(nll, args.segment),
                     "ppl": ppl(nll), "seconds": round(time.perf_counter() - t0, 1)})
        print(f"stream {spec.describe()}: PPL {rows[-1]['ppl']:.3f} over {len(ids)} tokens "
              f"({rows[-1]['seconds']} s); per {args.segment}: "
              + " ".join(f"{p:.2f}" for p in rows[-1]["segments"]), flush=True)
        results.append({**rows[-1], "stream": True})
        save(args, results)
    if args.stream_plot:
        plot_stream(rows, args.stream_plot, args.segment, args.chunk)


def plot_stream(rows: list[dict], path: str, segment: int, context: int) -> None:
    """PPL per segment against position in the text, one line per row."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 5))
    for r in rows:
        xs = [(i + 0.5) * segment for i in range(len(r["segments"]))]
        ax.plot(xs, r["segments"], marker="o", label=r["policy"] + (
            f" {r['budget']}" if r["budget"] else ""))
    ax.axvline(context, color="grey", linestyle=":",
               label=f"chunk of {context} (where full restarts)")
    ax.set_xlabel("position in the text (tokens)")
    ax.set_ylabel(f"perplexity ({segment}-token segments)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def plot(results: list[dict], path: str, chunk: int, bucket: int = 256) -> None:
    """PPL per ``bucket``-position bucket against position: one panel per budget, one line per
    run of that budget, ``full`` (no budget) in every panel; one colour per policy."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    budgets = sorted({r["budget"] for r in results if r["budget"]}) or [None]
    colours = dict(zip(("full", "window", "sinks", "h2o", "snapkv"), plt.cm.tab10.colors))
    fig, axes = plt.subplots(len(budgets), 1, figsize=(9, 3.2 * len(budgets)), sharex=True,
                             sharey=True, squeeze=False)
    for ax, budget in zip(axes[:, 0], budgets):
        for r in (r for r in results if r["budget"] in (None, budget)):
            nll = torch.tensor(r["nll_by_position"])
            xs, ys = [], []
            for lo in range(0, len(nll), bucket):
                part = nll[lo: lo + bucket]
                part = part[~torch.isnan(part)]
                if len(part):
                    xs.append(lo + bucket / 2)
                    ys.append(math.exp(float(part.mean())))
            label = r["policy"] + (f" {r['select']}" if r.get("select") else "")
            ax.plot(xs, ys, label=label, color=colours.get(r["policy"]),
                    linestyle="--" if r["policy"] == "snapkv" else "-")
        ax.set_title(f"budget {budget} tokens" if budget else "no budget", fontsize=9)
        ax.set_ylabel(f"perplexity ({bucket}-token buckets)", fontsize=8)
        ax.set_yscale("log")
        ax.legend(fontsize=7, ncol=5)
    axes[-1, 0].set_xlabel(f"position in the {chunk}-token chunk")
    fig.tight_layout()
    fig.savefig(path, dpi=110)

if __name__ == "__main__":
    main()
