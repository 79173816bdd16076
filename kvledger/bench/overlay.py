"""Ledger overlay: the cost model's floors next to the measured curves (seed §3.2-§3.3).

For each level the ledger (:func:`kvledger.ledger.planner.plan`, same formulas as
``kvledger plan``) gives

- the **TTFT floor**: prefill FLOPs (``2 x active params x T`` + causal attention) over the
  device's peak FLOP/s at 100 % utilisation, for one request of the level's prompt length;
- the **TPOT floor**: (weights read + the batch's KV read) / memory bandwidth, for a batch of
  the level's concurrency at its mean decode context.

``measured / floor`` says how far the server is from the hardware's limit: near 1 is
bandwidth- or compute-bound at full speed; a ratio that grows with length points at overheads
that scale with context (attention kernels, memory traffic the ledger does not count).
"""

from __future__ import annotations

from kvledger.bench.records import BenchResult

NOTE = ("TTFT floor: prefill FLOPs of ONE request at 100 % of peak FLOP/s, at every concurrency "
        "(a level of concurrency c prefills up to c prompts together, so its measured / floor "
        "includes that queueing: compare TTFT ratios within one concurrency); TPOT floor: "
        "bytes read per decode step (weights + the KV of a batch of the level's concurrency) "
        "over peak bandwidth")


class _Ledger:
    """Cached ledger figures for one (model, device, dtype)."""

    def __init__(self, plan_model: str, device_name: str, dtype: str | None) -> None:
        from kvledger.ledger.hardware import get_device
        from kvledger.model.families import load_spec

        self.spec = load_spec(plan_model)
        self.device = get_device(device_name)
        self.dtype = dtype
        self._rows: dict[tuple[int, int], object] = {}

    def row(self, tokens: int, batch: int):
        """The planner's ContextRow for ``tokens`` of context and a batch of ``batch``."""
        from kvledger.ledger.planner import PlanOptions, plan

        key = (max(1, tokens), max(1, batch))
        if key not in self._rows:
            options = PlanOptions(contexts=(key[0],), batch=key[1],
                                  kv_format=self.dtype or "bf16", weights_dtype=self.dtype)
            self._rows[key] = plan(self.spec, self.device, options).contexts[0]
        return self._rows[key]


def apply_overlay(result: BenchResult, plan_model: str, device: str,
                  dtype: str | None = None) -> None:
    """Fill ``result.overlay`` with per-level measured/floor rows and the floor curves.

    ``dtype`` is the weights and KV dtype the server runs (e.g. ``fp32`` for ``kvledger
    serve``'s default); None takes the planner's defaults (a GGUF's own bytes, bf16 KV).

    Raises:
        KVLedgerError: unknown model path or device (from the ledger).
    """
    ledger = _Ledger(plan_model, device, dtype)
    rows, ttft_curve, tpot_curve = [], [], []
    base_c = min((s["concurrency"] for s in result.summaries), default=1)
    for s in result.summaries:
        ttft, tpot = s["ttft_s"]["p50"], s["tpot_s"]["p50"]
        if s["workload"] == "sweep" and ttft is not None and s["prompt_tokens_mean"]:
            n = round(s["prompt_tokens_mean"])
            floor = ledger.row(n, 1).ttft_floor_s
            rows.append({"level": s["level"], "metric": "TTFT", "measured": ttft,
                         "floor": floor, "ratio": ttft / floor, "floor_basis": "1 request"})
            if s["concurrency"] == base_c:
                ttft_curve.append((n, floor))
        if s["workload"] in ("sweep", "chat-growth") and tpot is not None:
            n = round(s["context_tokens_mean"])
            floor = ledger.row(n, s["concurrency"]).tpot_floor_s
            rows.append({"level": s["level"], "metric": "TPOT", "measured": tpot,
                         "floor": floor, "ratio": tpot / floor,
                         "floor_basis": f"batch of {s['concurrency']}"})
            if s["concurrency"] == base_c:
                tpot_curve.append((n, floor))
    d = ledger.device
    result.overlay = {
        "title": f"{ledger.spec.name} on {d.name}: {d.bandwidth_gbs:g} GB/s, {d.tflops:g} TFLOPS "
                 f"({d.source}); dtype {dtype or 'planner default'}",
        "rows": rows,
        "ttft_curve": sorted(set(ttft_curve)),
        "tpot_curve": sorted(set(tpot_curve)),
        "notes": [NOTE],
    }
