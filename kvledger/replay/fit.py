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
prefill chunks of many sizes, decode batches at several contexts, and mixed steps.
"""

from __future__ import annotations

import itertools
import random
import time

import numpy as np

from kvledger.replay.step_model import Efficiency, StepFeatures, StepTimeModel

UNBOUNDED = 1e9
GRID = ((64, 1), (64, 8), (64, 32), (512, 1), (512, 8), (1536, 1), (1536, 4))
"""(prompt tokens, requests at once) cells of ``probe --steps``."""


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


def samples_from_trace(steps: list[dict]) -> list[tuple[StepFeatures, float]]:
    """(features, seconds) of a recorded trace's steps, the seconds being the step's *period*:
    from its start to the next step's start when the engine went straight on (the next step
    runs a request this one ran), which counts the server's work between steps; else its
    recorded duration."""
    samples = []
    for step, nxt in zip(steps, [*steps[1:], None]):
        f = StepFeatures.of([(start, n) for _, start, n in step["chunks"]])
        seconds = step["duration_s"]
        if nxt is not None and {c[0] for c in step["chunks"]} & {c[0] for c in nxt["chunks"]}:
            seconds = nxt["start_s"] - step["start_s"]
        if f.seqs:
            samples.append((f, seconds))
    return samples


def measure_steps(engine, grid=GRID, output_tokens: int = 6,
                  seed: int = 0) -> list[tuple[StepFeatures, float]]:
    """Run ``engine`` (an LLMEngine) over ``grid``; return every step's (features, seconds).

    Prompts are random token ids (no prefix-cache hits); requests ignore EOS.
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
