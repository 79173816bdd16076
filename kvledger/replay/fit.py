"""Fit the step-time model's efficiency factors to measured steps (``kvledger probe --steps``).

The model (:mod:`kvledger.replay.step_model`) is linear in its unknowns:

    duration = step_overhead_s x 1 + seq_overhead_s x S + (1/mfu) x compute_s + (1/mbu) x memory_s

so the factors are a non-negative least-squares fit over the measured steps. Residuals are
relative (each row divided by its measured duration): a 30 ms decode step counts as much as a
1 s prefill step, which is what TPOT needs. Non-negativity is solved exactly by trying every
subset of the four columns (the optimum is the unconstrained fit on its own support) and
keeping the best fit whose coefficients are all >= 0. A coefficient fitted to 0 means that term
explains nothing here; its factor is reported as :data:`UNBOUNDED`.

:func:`measure_steps` runs the real engine over a grid of (prompt length, batch) cells, each
``batch`` requests of ``prompt`` random tokens and a few output tokens, so the steps cover
prefill chunks of many sizes, decode batches at several contexts, and mixed steps. Under an
evicting policy the grid is :func:`policy_grid`: its long prompts pass the policy's bound, so
the measured steps evict (prefill chunks and decode alike) and run the policy's code path as
a long live request does.
"""

from __future__ import annotations

import itertools
import random
import time

import numpy as np

from kvledger.ledger.retention import EVICTION_CHUNK, RetentionSpec
from kvledger.replay.step_model import Efficiency, StepFeatures, StepTimeModel, kept_context
from kvledger.replay.trace import Trace

UNBOUNDED = 1e9
GRID = ((64, 1), (64, 8), (64, 32), (512, 1), (512, 8), (1536, 1), (1536, 4))
"""(prompt tokens, requests at once) cells of ``probe --steps`` under full retention."""
OUTPUT_TOKENS = 6
"""Tokens each request of :data:`GRID` generates."""
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
        ValueError: fewer than 4 samples.
    """
    if len(samples) < 4:
        raise ValueError(f"need at least 4 measured steps to fit, got {len(samples)}")
    rows = []
    for f, _ in samples:
        compute, memory = model.terms(f)
        rows.append([1.0, float(f.seqs), compute, memory])
    y = np.array([t for _, t in samples])
    a = np.array(rows) / y[:, None]
    ones = np.ones(len(y))
    best, best_err = np.zeros(4), np.inf
    for k in range(1, 5):
        for cols in itertools.combinations(range(4), k):
            coef, *_ = np.linalg.lstsq(a[:, cols], ones, rcond=None)
            if (coef < 0).any():
                continue
            err = float(np.sum((a[:, cols] @ coef - ones) ** 2))
            if err < best_err:
                best_err, best = err, np.zeros(4)
                best[list(cols)] = coef
    overhead, per_seq, c, m = (float(x) for x in best)
    eff = Efficiency(mfu=1 / c if c > 0 else UNBOUNDED, mbu=1 / m if m > 0 else UNBOUNDED,
                     step_overhead_s=overhead, seq_overhead_s=per_seq, source=source)
    rel = np.abs(np.array(rows) @ best / y - 1)
    return eff, {"samples": len(samples), "median_rel_error": float(np.median(rel)),
                 "p90_rel_error": float(np.quantile(rel, 0.9))}


def samples_from_trace(trace: Trace, spec: RetentionSpec) -> list[tuple[StepFeatures, float]]:
    """(features, seconds) of a recorded trace's steps, the seconds being the step's *period*:
    from its start to the next step's start when the engine went straight on (the next step
    runs a request this one ran), which counts the server's work between steps; else its
    recorded duration.

    ``spec`` is the policy fitted (the recording engine's default): each chunk's context is
    what a sequence under it holds (:func:`~kvledger.replay.step_model.kept_context`, from the
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
                             for rid, start, n in step["chunks"]])
        seconds = step["duration_s"]
        if nxt is not None and {c[0] for c in step["chunks"]} & {c[0] for c in nxt["chunks"]}:
            seconds = nxt["start_s"] - step["start_s"]
        if f.seqs:
            samples.append((f, seconds))
    return samples


def measure_steps(engine, grid=GRID, output_tokens: int = OUTPUT_TOKENS,
                  seed: int = 0) -> list[tuple[StepFeatures, float]]:
    """Run ``engine`` (an LLMEngine) over ``grid``; return every step's (features, seconds).

    Prompts are random token ids (no prefix-cache hits); requests ignore EOS and run under
    the engine's default retention policy.
    """
    from kvledger.engine.sampling_params import SamplingParams

    rng = random.Random(seed)
    vocab = engine.spec.vocab_size
    samples = []
    for cell, (prompt, batch) in enumerate(grid):
        params = SamplingParams(max_tokens=output_tokens, ignore_eos=True, temperature=0.0)
        for i in range(batch):
            ids = [rng.randrange(vocab) for _ in range(prompt)]
            engine.add_request(f"probe-{cell}-{i}", ids, params)
        while engine.has_unfinished_requests():
            start = time.perf_counter()
            engine.step()
            seconds = time.perf_counter() - start
            plan = engine.last_schedule
            if plan is not None and plan.chunks:
                samples.append((StepFeatures.of_plan(plan), seconds))
    return samples
