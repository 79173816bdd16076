"""``kvledger replay``: predict a trace's TTFT, TPOT, queueing and preemptions on a device.

The engine's own Scheduler and KV cache manager run the trace in simulated time
(:mod:`kvledger.replay.simulator`) with step durations from the ledger's compute and bandwidth
terms (:mod:`kvledger.ledger.step_model`), scaled on ``--device local`` by the ``probe --steps``
fit of each setting's retention policy (:mod:`kvledger.ledger.local_fits`; without one, the
full-retention fit and a line saying so). Writes the ``kvledger bench`` report files into
``--out`` and prints a summary, or one row per setting with ``--sweep``.
"""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path
from typing import Annotated

import typer

from kvledger.commands.engine_options import engine_options
from kvledger.engine.config import EngineConfig
from kvledger.errors import InvalidParameterError

Opt = typer.Option
NOT_REPLAYED = ("model", "use_kv_cache", "device", "num_threads", "attention", "kv_disk_dir",
                "kv_disk_gib", "kv_ram_gib")


def _ms(value) -> str:
    return "-" if value is None else f"{value * 1e3:.1f}"


@engine_options(exclude=NOT_REPLAYED)
def replay(
    trace: Annotated[str, typer.Argument(help="Trace file: JSON lines (kvledger/replay/"
                                              "trace.py, e.g. from `serve --trace`) or an Azure "
                                              "LLM inference trace .csv.")],
    device: Annotated[str, Opt(help="Device: a `kvledger plan` device, or 'local' (after "
                                    "`kvledger probe`).")],
    model: Annotated[str, Opt(help="Model: config.json, GGUF, a catalogue name or "
                                   "'default'.")] = "default",
    weights_dtype: Annotated[str | None, Opt(
        help="Weights format for the bytes read per step (default: the checkpoint's).")] = None,
    link_gbs: Annotated[float | None, Opt(
        help="Bandwidth between tensor-parallel ranks, GB/s per direction (default: the "
             "device's NVLink/PCIe figure, kvledger/ledger/interconnect.py).")] = None,
    speed: Annotated[float, Opt(help="Load multiplier: arrival times are divided by it.")] = 1.0,
    slo: Annotated[str | None, Opt(help="Targets for goodput, e.g. ttft:500,tpot:50 (ms).")]
    = None,
    compare: Annotated[str | None, Opt(help="A `kvledger bench` results.json to compare with.")]
    = None,
    sweep: Annotated[str | None, Opt(help="One run per value, e.g. max-num-seqs=16,32,64.")]
    = None,
    step_times: Annotated[str, Opt(help="model (the step-time model) or trace (the recorded "
                                        "step durations).")] = "model",
    engine_from_trace: Annotated[bool, Opt(
        help="Use the recording engine's options (from the trace header) instead of the "
             "engine options given here.")] = False,
    max_requests: Annotated[int | None, Opt(
        help="Replay only the first N requests of the trace.")] = None,
    out: Annotated[str, Opt(help="Output folder.")] = "replay-out",
    *,
    engine_config: EngineConfig,
) -> None:
    """Replay a trace through the real scheduler in simulated time; predict its latencies."""
    from kvledger.bench.records import BenchResult
    from kvledger.ledger.hardware import get_device
    from kvledger.model.catalogue import load_model_spec
    from kvledger.replay import report, setup
    from kvledger.replay.azure import read_azure
    from kvledger.replay.trace import read_trace

    if speed <= 0:
        raise InvalidParameterError(f"--speed must be > 0, got {speed}")
    if step_times not in ("model", "trace"):
        raise InvalidParameterError(f"--step-times must be model or trace, got {step_times!r}")
    slo_targets = report.SLO.parse(slo)
    swept = setup.parse_sweep(sweep)
    measured = report.load_bench_summary(compare) if compare else None
    dev = get_device(device)
    if max_requests is not None and max_requests < 1:
        raise InvalidParameterError(f"--max-requests must be >= 1, got {max_requests}")
    tr = read_azure(trace, max_requests) if trace.endswith(".csv") else read_trace(trace)
    if max_requests is not None:
        tr.requests = tr.requests[:max_requests]
    spec = load_model_spec(model)
    config = setup.recorded_config(tr.header) if engine_from_trace else engine_config
    runs = setup.settings(setup.Setting(config, speed), swept)
    for s in runs:  # refuse before printing anything
        setup.check_replayable(s.config, dev, link_gbs)
    priced = [setup.efficiency_for(dev, s.config) for s in runs]  # (factors, note) per setting
    per_setting = len({eff.source for eff, _ in priced}) > 1
    from_trace = measured is None
    if from_trace:
        measured = report.measured_figures(tr)
        if measured and not _reruns_recording(tr, spec, dev, config, speed, swept):
            measured = None
            print("not compared with the trace's own measurements: this replay changes what "
                  "was recorded (compare with --device local --engine-from-trace, the same "
                  "model, no --speed or --sweep; or --compare a bench results.json)")
    finishes = [r.finish for r in tr.requests if r.finish]
    print(f"replay of {trace} ({len(tr.requests)} requests, {len(tr.refused)} refused live) "
          f"for {spec.name} on {dev.name}; step model: "
          + ("per setting, below" if per_setting else priced[0][0].source))
    for note in dict.fromkeys(note for _, note in priced if note):
        print(note)
    rows, out_dir = [], Path(out)
    for s, (eff, _) in zip(runs, priced):
        if per_setting:
            print(f"step model for {s.label}: {eff.source}")
        run = setup.simulate(tr, spec, dev, eff, s, weights_dtype, step_times, link_gbs)
        summary, records = report.summary(run, s.label, s.config.max_num_seqs, slo_targets)
        meta = {"trace": trace, "model": spec.name, "device": dev.name,
                "kv_format": setup.kv_format_of(s.config, dev).name,
                "setting": s.label, "step_model": eff.source, "step_times": step_times,
                "speed": s.speed, "tp": s.config.tensor_parallel_size, "link_gbs": link_gbs,
                "engine": dataclasses.asdict(s.config),
                "num_blocks": run.num_blocks}
        result = BenchResult(meta=meta, summaries=[summary], records=records)
        folder = out_dir / s.label.replace("=", "-") if swept else out_dir
        report.write(result, run, finishes, folder)
        rows.append((s, report.predicted_figures(run, tr) if from_trace else summary, summary,
                     folder))
    _print(rows, measured, slo_targets is not None)


def _reruns_recording(tr, spec, device, config, speed: float, swept) -> bool:
    """Whether this replay re-runs what the trace recorded, so that the trace's own finish
    lines are the measurement to compare with: ``--device local``, the recording model and
    engine options (``--engine-from-trace``), speed 1, no sweep."""
    from kvledger.replay.setup import recorded_config

    if swept or speed != 1 or device.name != "local" or tr.header.get("model") != spec.name:
        return False
    try:
        return recorded_config(tr.header) == config
    except InvalidParameterError:  # no engine options recorded (a bench trace)
        return False


def _print(rows, measured, with_slo: bool) -> None:
    from rich.console import Console
    from rich.table import Table

    from kvledger.replay.report import compare_rows

    console = Console() if sys.stdout.isatty() else Console(width=160)
    grid = Table(title="kvledger replay (predicted, server-side)")
    cols = ["setting", "done/n", "refused", "TTFT p50 s", "TTFT p90 s", "TTFT p99 s",
            "TPOT p50 ms", "TPOT p90 ms", "queue p50 s", "out tok/s", "preempt", "KV peak %"]
    cols += ["SLO met", "goodput req/s"] if with_slo else []
    for c in cols:
        grid.add_column(c)
    for s, _, m, _ in rows:
        cells = [s.label, f"{m['requests'] - m['failures']}/{m['requests']}", str(m["refused"]),
                 f"{m['ttft_s']['p50'] or 0:.3f}", f"{m['ttft_s']['p90'] or 0:.3f}",
                 f"{m['ttft_s']['p99'] or 0:.3f}", _ms(m["tpot_s"]["p50"]),
                 _ms(m["tpot_s"]["p90"]), f"{m['queue_s']['p50'] or 0:.3f}",
                 f"{m['output_throughput_tok_s'] or 0:.1f}",
                 str(int(m["metrics"]["preemptions"])),
                 f"{100 * m['metrics']['kv_usage_peak']:.0f}"]
        if with_slo:
            cells += [f"{100 * (m['slo_attained'] or 0):.0f}%", f"{m['goodput_req_s'] or 0:.2f}"]
        grid.add_row(*cells)
    console.print(grid)
    for s, _, m, folder in rows:
        if m["refused_context"]:
            n = m["refused_context"]
            console.print(f"{s.label}: {n} request{'s' if n > 1 else ''} exceed"
                          f"{'' if n > 1 else 's'} the model's context (refused, counted above)")
        console.print(f"wrote {folder}/results.json, results.csv, report.html")
    if measured:
        console.print("predicted vs measured (relative error; preemptions: difference):")
        for s, m, _, _ in rows:
            for name, p, meas, err in compare_rows(m, measured):
                if name == "preemptions":
                    console.print(f"  {s.label} {name}: {p:.0f} vs {meas:.0f} ({err:+.0f})")
                else:
                    console.print(f"  {s.label} {name}: {p:.4f} s vs {meas:.4f} s "
                                  f"({100 * err:+.1f} %)")
