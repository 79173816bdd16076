"""``kvledger probe``: measure this machine for the planner and for the engine's kernels.

What it measures, and where it goes:

- the ``local`` device (memory, bandwidth, matmul TFLOPS; :mod:`kvledger.device.measure`) for
  ``kvledger plan --device local``, saved in the config folder (``local_device.json``);
- the kernel probe (:mod:`kvledger.engine.tuning.probe`) on ``--device``: per matmul shape
  class of ``--model`` the decode time of each weight format, and of each attention backend,
  with what the engine will choose; cached in ``cache_dir()/probe/kernels.json`` (the engine probes on first use
  anyway; this command re-measures and prints it);
- with ``--kv-disk-dir DIR``, the disk KV tier's load speed (bytes per second and seconds per
  file), page cache dropped and warm (:mod:`kvledger.engine.kv.tiers.read_probe`), and the
  prefill speed of ``--model`` on an engine (:func:`prefill_speed`), saved in the config folder
  (``kv_tier_read.json``), from which the engine chooses to load or recompute (and predicts
  each load);
- with ``--steps``, the step model of ``kvledger replay --device local``: engine steps timed
  over a grid and the efficiency factors fitted (:mod:`kvledger.replay.probe_steps`), saved in
  the config folder (``local_step_model.json``, one fit per retention policy:
  :mod:`kvledger.ledger.local_fits`); the engine's retention options (``--kv-policy``,
  ``--kv-window``, ``--kv-sinks``, ``--kv-budget``, ``--kv-positions``, ``--kv-select``, ``--kv-scope``) run
  the grid under that policy.
"""

from __future__ import annotations

import dataclasses
from typing import Annotated

import typer

from kvledger.commands.engine_options import engine_options
from kvledger.engine.config import EngineConfig
from kvledger.errors import InvalidParameterError

Opt = typer.Option
RETENTION_OPTIONS = ("kv_policy", "kv_window", "kv_sinks", "kv_budget", "kv_positions",
                     "kv_select", "kv_scope")
"""The engine options ``probe --steps`` takes: the default retention policy of its engine."""
PROBE_OPTIONS = ("device", *RETENTION_OPTIONS)
"""The engine options ``probe`` takes: the device it measures, and the above."""


@engine_options(exclude=tuple(f.name for f in dataclasses.fields(EngineConfig)
                              if f.name not in PROBE_OPTIONS))
def probe(
    buffer_mib: Annotated[int, Opt(help="Bytes copied per bandwidth trial, MiB")] = 512,
    matmul_n: Annotated[
        int | None, Opt(help="Square matmul side (default 8192 GPU; CPU: up to 2048, the largest "
                       "taking under 0.25 s)")
    ] = None,
    repeats: Annotated[int, Opt(help="Timed trials; the best counts")] = 5,
    model: Annotated[str, Opt(help="Model whose matmul shapes the kernel probe times")] = "default",
    kernels: Annotated[bool, Opt(help="Also run the kernel probe (--no-kernels skips it)")] = True,
    threads: Annotated[int | None, Opt(help="torch threads for the kernel probe (default: "
                                            "as the engine, the CPUs usable here)")] = None,
    steps: Annotated[bool, Opt(help="Also time engine steps over a grid and fit the step "
                                    "model of `kvledger replay --device local`")] = False,
    steps_from: Annotated[str | None, Opt(
        help="With --steps: fit on the steps a trace recorded (serve --trace) instead of "
             "timing a grid; the fit is that of the policy the trace's engine ran")] = None,
    kv_disk_dir: Annotated[str | None, Opt(
        help="Also measure this disk KV tier directory's read speed (page cache dropped, "
             "and warm) and --model's prefill speed; the engine chooses load or recompute "
             "with them")] = None,
    *,
    engine_config: EngineConfig,
) -> None:
    """Measure this machine (bandwidth, FLOPS, kernels); save it as device 'local'."""
    from kvledger.device.measure import measure
    from kvledger.ledger.hardware import save_local_device

    for name, value in (("--buffer-mib", buffer_mib), ("--repeats", repeats),
                        ("--matmul-n", matmul_n), ("--threads", threads)):
        if value is not None and value <= 0:
            raise InvalidParameterError(f"{name} must be positive, got {value}")
    if engine_config.retention.evicts and not steps:
        raise InvalidParameterError("--kv-policy applies to --steps (the step model's fit of "
                                    "that policy)")
    if steps_from is not None:
        if not steps:
            raise InvalidParameterError("--steps-from applies to --steps (fit the step model "
                                        "on that trace's steps)")
        from kvledger.replay.setup import recorded_config
        from kvledger.replay.trace import read_trace

        recorded_config(read_trace(steps_from).header)  # refuse before measuring anything
    if kernels or steps:
        from kvledger.device import resolve

        device = resolve(engine_config.device)  # an unavailable device: refused before measuring
        if not device.probes:
            raise InvalidParameterError(
                f"--device {device.name} is not probed: its choices are fixed "
                f"({', '.join(f'{k} {v}' for k, v in device.choices.items())}; docs/gpu.md)")
    dev = measure(buffer_mib, matmul_n, repeats)
    path = save_local_device(dev)
    print(
        f"local device: {dev.memory_gib:.2f} GiB memory, {dev.bandwidth_gbs:.1f} GB/s, "
        f"{dev.tflops:.3f} TFLOPS ({dev.source})\n"
        f"saved to {path}; use `kvledger plan --device local`"
    )
    if kv_disk_dir is not None:
        _tier_probe(kv_disk_dir, model)
    if kernels:
        _kernel_probe(model, threads, engine_config.device)
    if steps:
        from kvledger.replay.probe_steps import probe_steps

        for line in probe_steps(dev, model, threads, steps_from, engine_config):
            print(line)


def _tier_probe(directory: str, model: str) -> None:
    from kvledger.engine.kv.tiers import read_probe
    from kvledger.engine.kv.tiers.tier_dir import open_tier_dir
    from kvledger.ledger.tier_load import save_figures
    from kvledger.model.families import load_spec
    from kvledger.paths import config_dir

    tensor_bytes = read_probe.store_tensor_bytes(load_spec(model))
    tier_dir = open_tier_dir(directory)  # created, writable and not in use, or refused
    try:
        figures = read_probe.measure_read(tier_dir.path, tensor_bytes)
    finally:
        tier_dir.close()
    figures |= prefill_speed(model)
    path = save_figures(tier_dir.path, figures, config_dir())
    print(f"KV disk tier {directory}: loads {figures['cold_bytes_per_s'] / 1e9:.2f} GB/s + "
          f"{figures['cold_file_s'] * 1e6:.0f} µs per file with the page cache dropped, "
          f"{figures['warm_bytes_per_s'] / 1e9:.2f} GB/s + {figures['warm_file_s'] * 1e6:.0f} µs "
          f"warm ({figures['files']} files of {figures['payload_bytes']} bytes); prefill "
          f"{figures['prefill_flops_per_s'] / 1e9:.1f} GFLOP/s ({model}, "
          f"{figures['prefill_tokens']} tokens, {figures['prefill_dtype']}); saved to {path}")


def prefill_speed(model: str, tokens: int = 512) -> dict:
    """The prefill speed of an engine of ``model`` (default dtype): the ledger's prefill FLOPs
    of ``tokens`` random tokens (fewer when the model's context is shorter) over the best of
    two timed prefills, after one to warm up.
    ``{"prefill_flops_per_s", "prefill_model", "prefill_dtype", "prefill_tokens"}``."""
    import random
    import time

    from kvledger.engine.engine import LLMEngine
    from kvledger.engine.sample.sampling_params import SamplingParams
    from kvledger.ledger.costs import prefill_flops
    from kvledger.ledger.params import count_params

    engine = LLMEngine(EngineConfig(model=model, enable_prefix_caching=False))
    rng, best = random.Random(0), float("inf")
    try:
        tokens = min(tokens, engine.max_model_len - 1)
        for i in range(3):
            engine.add_request(f"prefill-{i}", [rng.randrange(3, engine.spec.vocab_size)
                                                for _ in range(tokens)],
                               SamplingParams(max_tokens=1, temperature=0.0))
            start = time.perf_counter()
            while engine.has_unfinished_requests():
                engine.step()
            if i:
                best = min(best, time.perf_counter() - start)
        flops = prefill_flops(engine.spec, tokens, count_params(engine.spec).active)
        return {"prefill_flops_per_s": flops / best, "prefill_model": model,
                "prefill_dtype": engine.config.dtype, "prefill_tokens": tokens}
    finally:
        engine.close()


def _is_kquant_gguf(spec) -> bool:
    """Whether ``spec`` was read from a GGUF file with K-quant matrices (held as its blocks)."""
    from pathlib import Path

    from kvledger.model.families import family_of
    from kvledger.model.weights.gguf_tensors import is_kquant_file
    from kvledger.spec import open_gguf

    source = Path(spec.source)
    return spec.gguf is not None and source.is_file() \
        and is_kquant_file(open_gguf(source), family_of(spec))


def _kernel_probe(model: str, threads: int | None, device_name: str) -> None:
    from kvledger.device import resolve
    from kvledger.engine.tuning import probe as kernel_probe
    from kvledger.engine.tuning import timing as probe_timing
    from kvledger.model.families import load_spec

    device = resolve(device_name)
    device.threads(threads)  # the count an engine would run
    spec = load_spec(model)
    result = kernel_probe.probe(spec, device, refresh=True)
    cpu_model, _, flags = result.cpu.partition(" | ")
    simd = [f for f in flags.split() if f.startswith(("avx", "amx", "fma", "f16c"))]
    print(f"CPU: {cpu_model}; flags: {' '.join(simd) or '(none of avx/amx/fma)'}")
    print(f"torch {result.torch_version}, {result.threads} threads; kernel probe for "
          f"{spec.source} (µs per decode row, best of {probe_timing.REPEATS} interleaved rounds):")
    q4 = set(kernel_probe.CLASSES) - {"lm_head"}  # GGUF Q4 files pack the layers, not the head
    kquant = set(kernel_probe.CLASSES) if _is_kquant_gguf(spec) else set()
    for cls in kernel_probe.CLASSES:
        times = result.matmul_us[cls]
        timed = tuple(f for f in kernel_probe.candidates(cls, q4, kquant) if f in times)
        pick = result.weight_format(cls, timed) if timed else "kquant-torch"
        cells = "  ".join(f"{fmt} {us:9.1f}" for fmt, us in times.items())
        print(f"  {cls:8s} {cells}   -> {pick}")
        for fmt, by_rows in result.gemm_us.get(cls, {}).items():
            cells = "  ".join(f"{rows}: " + "/".join(f"{us:.0f}" for us in t.values())
                              for rows, t in by_rows.items())
            names = "/".join(next(iter(by_rows.values()), {"own": 0}))
            choice = result.gemm_choice(cls, fmt)
            pick = "own kernel" if choice is None else f"{choice[1]} GEMM from {choice[0]} rows"
            print(f"    {fmt:13s} rows: {names} µs  {cells}   -> {pick}")
    cells = "  ".join(f"{name} {us:8.1f}" for name, us in result.attention_us.items())
    print(f"  attention (1 query, {probe_timing.ATTENTION_CONTEXT} positions): {cells}   -> "
          f"{result.attention}")
    limits = result.fused_max_rows()
    for key, by_rows in result.fused_us.items():
        op, _, dtype = key.partition(":")
        cells = "  ".join(f"{rows}: {t['native']:.0f}/{t['torch']:.0f}" for rows, t in by_rows.items())
        limit = limits.get(op, {}).get(kernel_probe.FUSED_DTYPES[dtype])
        pick = "native at any rows" if limit is None else f"native up to {limit} rows"
        print(f"  {key:17s} rows: native/torch µs  {cells}   -> {pick}")
    print(f"saved to {kernel_probe._cache_file()}; force with KVLEDGER_WEIGHT_FORMAT / "
          "KVLEDGER_GEMM / KVLEDGER_ATTENTION")
