"""Fit the step-time model's efficiency factors to measured steps (``kvledger probe --steps``).

The model (:mod:`kvledger.ledger.step_model`) is linear in its unknowns:

    duration - weights_s / FIT_WEIGHTS_MBU = step_overhead_s x 1 + seq_overhead_s x S
        + decode_group_s x G + (1/mfu) x dense_s + (1/paged_mfu) x paged_s + (1/mbu) x kv_s

so the factors are a non-negative least-squares fit over the measured steps. The weight reads
are priced at the measured bandwidth (:data:`FIT_WEIGHTS_MBU`), not fitted: a dense model
reads the same weights every step, so a factor of their own would be the constant column
again (and folding them into ``mbu`` ties the price of a KV byte to the fixed cost: a fit with
``step_overhead_s`` pinned at 0 and the KV reads at a third of their measured price, 2-core
AMD EPYC, 2026-12-03). What the weights take beyond the measured bandwidth is in
``step_overhead_s``. Residuals are relative (each row divided by its measured duration): a
30 ms decode step counts as much as a 1 s prefill step, which is what TPOT needs.
Non-negativity is solved exactly by trying every subset of the six columns (the optimum is the
unconstrained fit on its own support) and keeping the best fit whose coefficients are all
>= 0. A coefficient fitted to 0 means that term explains nothing here; its factor is reported
as :data:`UNBOUNDED` (``paged_mfu`` None when no measured step had paged pairs: priced at
``mfu``).

:func:`measure_steps` runs the real engine over a grid of (prompt length, batch) cells, each
``batch`` requests of ``prompt`` random tokens and a few output tokens, so the steps cover
prefill chunks of many sizes, decode batches at several contexts, and mixed steps; then, under
full retention, the :data:`MIXED` batches (requests of spread prompt lengths up to 2,040
tokens decoding together, as live decode batches do: several length groups, long contexts)
and the :data:`PREFIXED` cells (a prefix, then requests that extend it: prefill chunks after
a prefix-cache hit, the paged pairs). Without those the grid held 35 decode steps at one
context each and none past 1,542 tokens, and no prefill after a hit. Under an evicting policy
the grid is :func:`policy_grid`: its long prompts pass the policy's bound, so the measured
steps evict (prefill chunks and decode alike) and run the policy's code path as a long live
request does.
"""

from __future__ import annotations

import itertools
import random
import time

import numpy as np

from kvledger.ledger.retention import EVICTION_CHUNK, RetentionSpec
from kvledger.ledger.step_model import Efficiency, StepFeatures, StepTimeModel, kept_context
from kvledger.replay.trace import Trace

UNBOUNDED = 1e9
GRID = ((64, 1), (64, 8), (64, 32), (512, 1), (512, 8), (1536, 1), (1536, 4))
"""(prompt tokens, requests at once) cells of ``probe --steps`` under full retention."""
OUTPUT_TOKENS = 6
"""Tokens each request of :data:`GRID` generates."""
MIXED = ((2040,), (256, 1024, 2040), (128, 384, 640, 896, 1152, 1408, 1664, 2040))
"""Prompt lengths of the batches ``probe --steps`` runs after :data:`GRID` under full
retention, each batch's requests sent at once (contexts spread as in a live decode batch)."""
MIXED_OUTPUT_TOKENS = 16
"""Tokens each request of :data:`MIXED` generates."""
PREFIXED = ((512, (1024,)), (512, (256, 1536)), (1024, (128, 512)))
"""(prefix tokens, suffix tokens of the requests sent together) of ``probe --steps`` under
full retention: the prefix runs alone first (its blocks stay in the prefix cache), then each
request is the prefix and its own suffix, prefilled after a cache hit."""
FIT_WEIGHTS_MBU = 1.0
"""``weights_mbu`` of a fit: the weight reads at the measured peak bandwidth (see above)."""
POLICY_OUTPUT_TOKENS = 32
"""Tokens each request of :func:`policy_grid` generates: two 16-token blocks of decode past
the bound, so a window / sinks sequence frees a block and an h2o one compacts a block's worth
of holes during the measured decode steps."""


def policy_grid(spec: RetentionSpec) -> tuple[tuple[int, int], ...]:
    """The (prompt tokens, requests at once) cells of ``probe --steps`` under evicting policy
    ``spec``: :data:`GRID`'s short cells (64-token prompts at batch 1, 8, 32, under the
    policy's code path but below its bound) and prompts of ``bound + 4 x EVICTION_CHUNK`` at
    batch 1 and 4, the bound being the capacity (window / sinks / h2o) or the budget the prompt
    is compressed to (snapkv): four 64-token prefill chunks past the bound evict, then every
    decode step does. Its steps grow with the bound (prefill runs in 64-token chunks)."""
    bound = spec.capacity if spec.capacity is not None else spec.prompt_keep
    long = bound + 4 * EVICTION_CHUNK
    return (*(cell for cell in GRID if cell[0] == 64), (long, 1), (long, 4))


def fit(samples: list[tuple[StepFeatures, float]], model: StepTimeModel,
        source: str) -> tuple[Efficiency, dict]:
    """Efficiency factors that best explain ``samples`` (features, measured seconds).

    Returns:
        (the factors, figures of the fit: samples, median and p90 absolute relative error).

    Raises:
        ValueError: fewer than 6 samples.
    """
    if len(samples) < 6:
        raise ValueError(f"need at least 6 measured steps to fit, got {len(samples)}")
    rows, weights = [], []
    for f, _ in samples:
        dense, paged, w, kv = model.parts(f)
        rows.append([1.0, float(f.seqs), float(f.decode_groups), dense, paged, kv])
        weights.append(w / FIT_WEIGHTS_MBU)
    y = np.array([t for _, t in samples])
    a = np.array(rows) / y[:, None]
    target = 1 - np.array(weights) / y
    width = a.shape[1]
    best, best_err = np.zeros(width), np.inf
    for k in range(1, width + 1):
        for cols in itertools.combinations(range(width), k):
            coef, *_ = np.linalg.lstsq(a[:, cols], target, rcond=None)
            if (coef < 0).any():
                continue
            err = float(np.sum((a[:, cols] @ coef - target) ** 2))
            if err < best_err:
                best_err, best = err, np.zeros(width)
                best[list(cols)] = coef
    overhead, per_seq, per_group, c, p, m = (float(x) for x in best)
    measured_paged = any(f.paged_pairs for f, _ in samples)
    eff = Efficiency(mfu=1 / c if c > 0 else UNBOUNDED, mbu=1 / m if m > 0 else UNBOUNDED,
                     step_overhead_s=overhead, seq_overhead_s=per_seq, source=source,
                     decode_group_s=per_group,
                     paged_mfu=(1 / p if p > 0 else UNBOUNDED) if measured_paged else None,
                     weights_mbu=FIT_WEIGHTS_MBU)
    rel = np.abs((np.array(rows) @ best + weights) / y - 1)
    return eff, {"samples": len(samples), "median_rel_error": float(np.median(rel)),
                 "p90_rel_error": float(np.quantile(rel, 0.9))}


def samples_from_trace(trace: Trace, spec: RetentionSpec) -> list[tuple[StepFeatures, float]]:
    """(features, seconds) of a recorded trace's steps, the seconds being the step's *period*:
    from its start to the next step's start when the engine went straight on (the next step
    runs a request this one ran), which counts the server's work between steps; else its
    recorded duration.

    ``spec`` is the policy fitted (the recording engine's default): each chunk's context is
    what a sequence under it holds (:func:`~kvledger.ledger.step_model.kept_context`, from the
    request's prompt length); steps that run a request whose ``sampling`` names another policy,
    or one the trace does not list, are left out.
    """
    requests = {r.id: r for r in trace.requests}
    policy = {rid: RetentionSpec.from_dict(r.sampling["kv_policy"])
              if r.sampling.get("kv_policy") else spec for rid, r in requests.items()}
    samples = []
    steps = trace.steps
    for step, nxt in zip(steps, [*steps[1:], None]):
        if any(policy.get(rid) != spec for rid, _, _ in step["chunks"]):
            continue
        f = StepFeatures.of([(kept_context(spec, start, requests[rid].prompt_tokens), n)
                             for rid, start, n in step["chunks"]], evicting=spec.evicts)
        seconds = step["duration_s"]
        if nxt is not None and {c[0] for c in step["chunks"]} & {c[0] for c in nxt["chunks"]}:
            seconds = nxt["start_s"] - step["start_s"]
        if f.seqs:
            samples.append((f, seconds))
    return samples


def measure_steps(engine, grid=GRID, output_tokens: int = OUTPUT_TOKENS, seed: int = 0,
                  mixed=(), prefixed=()) -> list[tuple[StepFeatures, float]]:
    """Run ``engine`` (an LLMEngine) over ``grid`` ((prompt tokens, requests) cells, each
    request generating ``output_tokens``), then the ``mixed`` batches (prompt lengths of
    requests sent at once, each generating :data:`MIXED_OUTPUT_TOKENS`) and the ``prefixed``
    cells (see :data:`PREFIXED`; each request generating ``output_tokens``); return every
    step's (features, seconds).

    Prompts are random token ids (no prefix-cache hits but those ``prefixed`` sets up);
    requests ignore EOS and run under the engine's default retention policy.
    """
    rng = random.Random(seed)

    def tokens(n: int) -> list[int]:
        return [rng.randrange(engine.spec.vocab_size) for _ in range(n)]

    batches = [([tokens(prompt) for _ in range(batch)], output_tokens) for prompt, batch in grid]
    batches += [([tokens(n) for n in prompts], MIXED_OUTPUT_TOKENS) for prompts in mixed]
    for prefix, suffixes in prefixed:
        head = tokens(prefix)
        batches += [([head], 1), ([head + tokens(n) for n in suffixes], output_tokens)]
    samples: list[tuple[StepFeatures, float]] = []
    for cell, (prompts, outputs) in enumerate(batches):
        _run_batch(engine, prompts, outputs, f"probe-{cell}", samples)
    return samples


def _run_batch(engine, prompts: list[list[int]], output_tokens: int, tag: str,
               samples: list) -> None:
    """Add ``prompts`` at once and step ``engine`` until they finish, appending each step's
    (features, seconds) to ``samples``."""
    from kvledger.engine.sample.sampling_params import SamplingParams

    params = SamplingParams(max_tokens=output_tokens, ignore_eos=True, temperature=0.0)
    for i, ids in enumerate(prompts):
        engine.add_request(f"{tag}-{i}", ids, params)
    while engine.has_unfinished_requests():
        start = time.perf_counter()
        engine.step()
        seconds = time.perf_counter() - start
        plan = engine.last_schedule
        if plan is not None and plan.chunks:
            samples.append((StepFeatures.of_plan(plan), seconds))
