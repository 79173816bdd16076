"""``kvledger probe --steps``: measure the local engine's steps, fit and save the factors.

One fit per retention policy (:mod:`kvledger.ledger.local_fits`): the grid runs on an engine
with the ``--kv-policy`` options given (:data:`~kvledger.replay.fit.GRID` under full retention,
:func:`~kvledger.replay.fit.policy_grid` under an evicting policy), or ``--steps-from TRACE``
fits the policy the trace's engine recorded (its header's options).
"""

from __future__ import annotations

import dataclasses

import numpy as np

from kvledger.engine.config import EngineConfig
from kvledger.errors import InvalidParameterError
from kvledger.ledger.local_fits import fit_key, save_fit
from kvledger.ledger.step_model import DEFAULT_EFFICIENCY, StepTimeModel
from kvledger.replay.fit import (
    GRID,
    MIXED,
    OUTPUT_TOKENS,
    POLICY_OUTPUT_TOKENS,
    PREFIXED,
    UNBOUNDED,
    fit,
    measure_steps,
    policy_grid,
    samples_from_trace,
)


def probe_steps(device, model: str, threads: int | None, trace: str | None = None,
                config: EngineConfig | None = None) -> list[str]:
    """Measure the grid on ``model`` under ``config``'s retention options (the other engine
    options at their defaults), or take the steps a ``trace`` recorded (their periods,
    :func:`~kvledger.replay.fit.samples_from_trace`, under the recording engine's policy); fit
    ``device``'s factors and save them as the ``local`` step model's fit of that policy;
    returns the lines to print.

    Raises:
        InvalidParameterError: retention options given with a trace (its header names the
            policy), a trace that records no engine options.
    """
    import time

    config = config or EngineConfig()
    t0 = time.perf_counter()
    if trace is None:
        spec, fmt, what, samples = _measure(
            dataclasses.replace(config, model=model, num_threads=threads))
        retention, block_size = config.retention, config.block_size
    else:
        from kvledger.model.catalogue import load_model_spec
        from kvledger.replay.setup import kv_format_of, recorded_config
        from kvledger.replay.trace import read_trace

        if config.retention.evicts:
            raise InvalidParameterError(
                "--steps-from fits the policy the trace recorded (its header's engine "
                "options); drop the --kv-* options")
        tr = read_trace(trace)
        recorded = recorded_config(tr.header)
        retention = recorded.retention
        spec = load_model_spec(model)
        fmt, block_size = kv_format_of(recorded, device), recorded.block_size
        samples = samples_from_trace(tr, retention)
        what = f"steps recorded in {trace}"
    wall = time.perf_counter() - t0
    kv_format = fmt.name
    step_model = StepTimeModel(spec, device, DEFAULT_EFFICIENCY, fmt, block_size=block_size)
    when = time.strftime("%Y-%m-%d %H:%M")
    key = fit_key(retention)
    eff, stats = fit(samples, step_model, f"fitted by kvledger probe --steps on {when} "
                     f"({len(samples)} {what}, KV {kv_format}, retention {key})")
    defaults = [abs(step_model.duration(f) / t - 1) for f, t in samples]
    stats["defaults_median_rel_error"] = float(np.median(defaults))
    path = save_fit(retention, eff, device, stats | {"kv_format": kv_format})
    paged = "not measured" if eff.paged_mfu is None else _factor(eff.paged_mfu)
    use = ("full retention (and policies not calibrated)" if key == "full" else
           f"--kv-policy {retention.policy} (any sizes)")
    return [
        f"step probe: {len(samples)} steps in {wall:.1f} s ({what}; {retention.describe()})",
        (f"fitted: MFU {_factor(eff.mfu)} (paged pairs {paged}), KV MBU {_factor(eff.mbu)} "
        f"(weights at {eff.weights_factor:.3g} of the bandwidth), "
        f"{eff.step_overhead_s * 1e3:.2f} ms per step + "
        f"{eff.seq_overhead_s * 1e3:.3f} ms per sequence + "
        f"{eff.decode_group_s * 1e3:.3f} ms per decode group; median |error| "
        f"{100 * stats['median_rel_error']:.1f} % (p90 {100 * stats['p90_rel_error']:.1f} %)"),
        (f"the table devices' defaults (MFU {DEFAULT_EFFICIENCY.mfu}, MBU "
        f"{DEFAULT_EFFICIENCY.mbu}) would be off by a median "
        f"{100 * stats['defaults_median_rel_error']:.0f} % here"),
        (f"saved to {path} as the {key} fit: `kvledger replay TRACE --device local` prices "
        f"{use} with it"),
    ]


def _factor(value: float) -> str:
    """An efficiency factor as printed; :data:`UNBOUNDED` says its term was fitted to zero."""
    return "unbounded (term fitted to 0)" if value >= UNBOUNDED else f"{value:.3g}"


def _measure(config: EngineConfig):
    """(spec, KV format spec, description, samples) of the grid run on a fresh engine."""
    from kvledger.engine.engine import LLMEngine
    from kvledger.engine.sample.sampling_params import SamplingParams

    engine = LLMEngine(config)
    engine.add_request("warmup", [1] * 32, SamplingParams(max_tokens=2, ignore_eos=True))
    while engine.has_unfinished_requests():
        engine.step()
    retention = config.retention
    if retention.evicts:
        samples = measure_steps(engine, policy_grid(retention), POLICY_OUTPUT_TOKENS)
    else:
        samples = measure_steps(engine, GRID, OUTPUT_TOKENS, mixed=MIXED, prefixed=PREFIXED)
    what = (f"steps of {engine.model_name} ({engine.config.dtype}) over (prompt, batch) cells"
            + ("" if retention.evicts else ", mixed-length batches and prefix hits"))
    return engine.spec, engine.kv_layout.fmt, what, samples
