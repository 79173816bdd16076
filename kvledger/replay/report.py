"""A replay's figures, in the shape of ``kvledger bench``'s report (so the two overlay).

Per request: TTFT (arrival -> first token), TPOT ((last - first token) / (n - 1)), E2E
(arrival -> finish), queue time (arrival -> first scheduled), preemptions and KV peak (the most
blocks it held x bytes per block): the server-side definitions of ``/metrics``. Summaries:
p50/p90/p99 (``kvledger.bench.stats``), output and total throughput over the replay's span
(first arrival to last finish), and goodput: requests per second that met both SLOs (a request
with one output token has no TPOT and meets the TPOT SLO). The replay is written as a
``BenchResult`` with one level, so ``results.json``, ``results.csv``, the PNG plots and
``report.html`` come from :mod:`kvledger.bench.report` (the plots from
:mod:`kvledger.replay.plots`); ``results.json`` gains ``replay_requests`` (queue time,
preemptions, KV peak per request).
"""

from __future__ import annotations

import itertools
import json
from dataclasses import dataclass
from pathlib import Path

from kvledger.bench.metrics import LevelMetrics
from kvledger.bench.records import BenchResult, Level, RequestRecord
from kvledger.bench.report import write_csv, write_html, write_json
from kvledger.bench.stats import summarize, summarize_level
from kvledger.errors import KVLedgerError
from kvledger.replay import plots
from kvledger.replay.simulator import ReplayRun, SimRequest


@dataclass(frozen=True)
class SLO:
    """Latency targets in seconds (None = no target on that metric)."""

    ttft_s: float | None = None
    tpot_s: float | None = None

    @classmethod
    def parse(cls, text: str | None) -> SLO | None:
        """``ttft:MS,tpot:MS`` (milliseconds; either part may be left out).

        Raises:
            KVLedgerError: another key, a non-positive or non-numeric value.
        """
        if not text:
            return None
        values: dict[str, float] = {}
        for part in text.split(","):
            key, _, ms = part.strip().partition(":")
            if key not in ("ttft", "tpot"):
                raise KVLedgerError(f"--slo takes ttft:MS,tpot:MS, got {part!r}")
            try:
                value = float(ms)
            except ValueError:
                raise KVLedgerError(f"--slo {key} must be milliseconds, got {ms!r}") from None
            if value <= 0:
                raise KVLedgerError(f"--slo {key} must be > 0 ms, got {ms}")
            values[f"{key}_s"] = value / 1e3
        return cls(**values)

    def met(self, sim: SimRequest) -> bool:
        """True when the request finished within both targets."""
        if sim.finished_s is None:
            return False
        ttft_ok = self.ttft_s is None or sim.ttft_s <= self.ttft_s
        tpot_ok = self.tpot_s is None or sim.tpot_s is None or sim.tpot_s <= self.tpot_s
        return ttft_ok and tpot_ok


def _record(sim: SimRequest, label: str, concurrency: int) -> RequestRecord:
    req = sim.request
    ok = sim.finished_s is not None
    t = sim.token_times
    return RequestRecord(
        level=label, workload="replay", index=0, uid=sim.trace.id, phase="",
        concurrency=concurrency, level_prompt_len=sim.trace.prompt_tokens,
        target_prompt_tokens=sim.trace.prompt_tokens,
        requested_output_tokens=sim.target_output or 0, arrival_s=sim.arrival_s,
        send_s=sim.arrival_s, ok=ok, error=None if ok else (sim.refused or "not finished"),
        ttft_s=sim.ttft_s, e2e_s=sim.e2e_s, tpot_s=sim.tpot_s,
        output_tokens=len(req.output_token_ids) if req else None,
        prompt_tokens=sim.trace.prompt_tokens, content_events=len(t),
        itl_s=[b - a for a, b in itertools.pairwise(t)])


def summary(run: ReplayRun, label: str, concurrency: int, slo: SLO | None) -> tuple[dict,
                                                                                   list]:
    """(bench-shaped level summary + replay figures, request records) of a run."""
    records = [_record(s, label, concurrency) for s in run.requests]
    for i, r in enumerate(records):
        r.index = i
    start = min((s.arrival_s for s in run.requests), default=0.0)
    wall = max(run.end_s - start, 0.0)
    metrics = LevelMetrics(available=True, preemptions=run.preemptions,
                           kv_usage_peak=run.kv_peak_blocks / run.num_blocks)
    level = Level("replay", 0, concurrency, [])
    s = summarize_level(level, records, wall, metrics)
    s["level"] = label
    done = [x for x in run.requests if x.finished_s is not None]
    s["queue_s"] = summarize([x.queue_s for x in done if x.queue_s is not None])
    s["refused"] = sum(1 for x in run.requests if x.request is None)
    s["refused_context"] = sum(1 for x in run.requests
                               if x.refused and x.refused.startswith("context"))
    s["kv_peak_bytes"] = run.kv_peak_blocks * run.bytes_per_block
    s["num_blocks"] = run.num_blocks
    s["steps"] = len(run.steps)
    if slo is not None:
        good = sum(1 for x in run.requests if slo.met(x))
        s["slo"] = {"ttft_s": slo.ttft_s, "tpot_s": slo.tpot_s}
        s["slo_attained"] = good / len(run.requests) if run.requests else None
        s["goodput_req_s"] = good / wall if wall > 0 else None
    return s, records


def request_rows(run: ReplayRun) -> list[dict]:
    """Per-request figures beyond the bench's records: queue time, preemptions, KV peak."""
    return [{"id": s.trace.id, "queue_s": s.queue_s, "ttft_s": s.ttft_s, "tpot_s": s.tpot_s,
             "e2e_s": s.e2e_s,
             "preemptions": s.request.num_preemptions if s.request else 0,
             "kv_peak_bytes": (s.request.peak_num_blocks if s.request else 0)
             * run.bytes_per_block, "refused": s.refused} for s in run.requests]


def write(result: BenchResult, run: ReplayRun, measured: list | None, out_dir: Path) -> list:
    """Write the bench-shaped report of one run into ``out_dir``: results.json (plus
    ``replay_requests``), results.csv, the replay's plots (TTFT/TPOT CDFs against the
    ``measured`` finish lines when given, the step timeline) and report.html."""
    out_dir.mkdir(parents=True, exist_ok=True)
    label = result.summaries[0]["level"]
    pngs = [
        plots.cdf_plot({label: [s.ttft_s for s in run.requests]},
                       [f.get("ttft_s") for f in measured or []], "TTFT",
                       out_dir / "replay_ttft_cdf.png"),
        plots.cdf_plot({label: [s.tpot_s for s in run.requests]},
                       [f.get("tpot_s") for f in measured or []], "TPOT",
                       out_dir / "replay_tpot_cdf.png"),
        plots.timeline_plot(run.steps, out_dir / "replay_timeline.png"),
    ]
    paths = [write_json(result, out_dir / "results.json"),
             write_csv(result, out_dir / "results.csv"), *pngs,
             write_html(result, pngs, out_dir / "report.html")]
    body = json.loads(paths[0].read_text())
    paths[0].write_text(json.dumps(body | {"replay_requests": request_rows(run)}, indent=1,
                                   default=str))
    return paths


def measured_figures(trace) -> dict | None:
    """Server-side figures a recorded trace carries in its finish lines: TTFT, TPOT and
    preemptions of the requests that finished live (None if none has timings)."""
    fins = [r.finish for r in trace.requests if r.finish and r.finish.get("ttft_s") is not None]
    if not fins:
        return None
    return _figures([f["ttft_s"] for f in fins], [f.get("tpot_s") for f in fins],
                    sum(f.get("preemptions") or 0 for f in fins))


def predicted_figures(run: ReplayRun, trace) -> dict:
    """The replay's figures over the same requests as :func:`measured_figures` (those that
    finished live), so a partly recorded run compares like with like."""
    live = {r.id for r in trace.requests if r.finish and r.finish.get("ttft_s") is not None}
    sims = [s for s in run.requests if s.trace.id in live and s.request is not None]
    return _figures([s.ttft_s for s in sims], [s.tpot_s for s in sims],
                    sum(s.request.num_preemptions for s in sims))


def _figures(ttfts, tpots, preemptions) -> dict:
    return {"ttft_s": summarize([t for t in ttfts if t is not None]),
            "tpot_s": summarize([t for t in tpots if t is not None]),
            "preemptions": preemptions, "metrics": {"preemptions": preemptions}}


def compare_rows(predicted: dict, measured: dict) -> list[tuple[str, float, float, float]]:
    """(metric, predicted, measured, relative error) for TTFT/TPOT p50 and p90 and the
    preemption count; ``measured`` is a bench summary or :func:`measured_figures`."""
    rows = []
    for metric in ("ttft_s", "tpot_s"):
        for q in ("p50", "p90"):
            p, m = predicted[metric][q], (measured.get(metric) or {}).get(q)
            if p is not None and m:
                rows.append((f"{metric[:-2].upper()} {q}", p, m, (p - m) / m))
    p_pre = predicted["metrics"]["preemptions"]
    m_pre = measured.get("preemptions", (measured.get("metrics") or {}).get("preemptions"))
    if m_pre is not None:
        rows.append(("preemptions", p_pre, m_pre, p_pre - m_pre))
    return rows


def load_bench_summary(path: str) -> dict:
    """The first level summary of a ``kvledger bench`` results.json.

    Raises:
        KVLedgerError: missing file or not a bench results.json.
    """
    p = Path(path)
    try:
        body = json.loads(p.read_text())
        return body["summaries"][0]
    except FileNotFoundError:
        raise KVLedgerError(f"--compare: {path} not found") from None
    except (json.JSONDecodeError, KeyError, IndexError, TypeError):
        raise KVLedgerError(f"--compare: {path} is not a kvledger bench results.json") from None
