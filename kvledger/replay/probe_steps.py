"""``kvledger probe --steps``: measure the local engine's steps, fit and save the factors."""

from __future__ import annotations

import numpy as np

from kvledger.replay.fit import fit, measure_steps, samples_from_trace
from kvledger.replay.step_model import DEFAULT_EFFICIENCY, StepTimeModel, save_local_efficiency


def probe_steps(device, model: str, threads: int | None,
                trace: str | None = None) -> list[str]:
    """Measure the grid on ``model`` (default engine options), or take the steps a ``trace``
    recorded (their periods, :func:`samples_from_trace`), fit ``device``'s factors and save
    them as the ``local`` step model; returns the lines to print."""
    import time

    t0 = time.perf_counter()
    if trace is None:
        spec, kv_format, what, samples = _measure(model, threads)
    else:
        from kvledger.catalogue import load_model_spec
        from kvledger.replay.setup import kv_format_of, recorded_config
        from kvledger.replay.trace import read_trace

        tr = read_trace(trace)
        spec = load_model_spec(model)
        kv_format = kv_format_of(recorded_config(tr.header), device)
        samples = samples_from_trace(tr.steps)
        what = f"steps recorded in {trace}"
    wall = time.perf_counter() - t0
    step_model = StepTimeModel(spec, device, DEFAULT_EFFICIENCY, kv_format)
    when = time.strftime("%Y-%m-%d %H:%M")
    eff, stats = fit(samples, step_model, f"fitted by kvledger probe --steps on {when} "
                     f"({len(samples)} {what}, KV {kv_format})")
    defaults = [abs(step_model.duration(f) / t - 1) for f, t in samples]
    stats["defaults_median_rel_error"] = float(np.median(defaults))
    path = save_local_efficiency(eff, stats | {"kv_format": kv_format})
    return [
        f"step probe: {len(samples)} steps in {wall:.1f} s ({what})",
        (f"fitted: MFU {eff.mfu:.3g}, MBU {eff.mbu:.3g}, {eff.step_overhead_s * 1e3:.2f} ms per "
        f"step + {eff.seq_overhead_s * 1e3:.3f} ms per sequence; median |error| "
        f"{100 * stats['median_rel_error']:.1f} % (p90 {100 * stats['p90_rel_error']:.1f} %)"),
        (f"the table devices' defaults (MFU {DEFAULT_EFFICIENCY.mfu}, MBU "
        f"{DEFAULT_EFFICIENCY.mbu}) would be off by a median "
        f"{100 * stats['defaults_median_rel_error']:.0f} % here"),
        f"saved to {path}; use `kvledger replay TRACE --device local`",
    ]


def _measure(model: str, threads: int | None):
    """(spec, KV format, description, samples) of the grid run on a fresh engine."""
    from kvledger.engine.config import EngineConfig
    from kvledger.engine.engine import LLMEngine
    from kvledger.engine.sampling_params import SamplingParams

    engine = LLMEngine(EngineConfig(model=model, num_threads=threads))
    engine.add_request("warmup", [1] * 32, SamplingParams(max_tokens=2, ignore_eos=True))
    while engine.has_unfinished_requests():
        engine.step()
    samples = measure_steps(engine)
    what = f"steps of {engine.model_name} ({engine.config.dtype}) over (prompt, batch) cells"
    return engine.spec, engine.kv_format, what, samples
