"""``kvledger plan --replicas N`` / ``--target-rps R --ttft-p90 S``: the fleet plan
(:mod:`kvledger.ledger.fleet`) for the model on a device, with the step prices of the replay's
step model (:mod:`kvledger.ledger.step_model`: this machine's ``probe --steps`` fit for
``--device local``, the assumed factors elsewhere), rendered as a table or JSON. Like
``kvledger plan``, it imports no torch (the features are built here, not from a scheduler's
output).
"""

from __future__ import annotations

import json
import math
from dataclasses import fields

from rich.console import Console
from rich.table import Table

from kvledger.errors import InvalidParameterError
from kvledger.ledger.fleet import FleetPlan, ReplicaSize, SharedPrefixMix, StepPrices, fleet_plan
from kvledger.ledger.hardware import Device
from kvledger.ledger.kv_format import KVFormatSpec
from kvledger.ledger.planner import Plan
from kvledger.spec import ModelSpec


def step_prices(spec: ModelSpec, device: Device, kv: KVFormatSpec, mix: SharedPrefixMix,
                concurrency: int, block_size: int, tp: int) -> tuple[StepPrices, str]:
    """(the prices of one replica's steps on ``mix``, where the factors come from)."""
    from kvledger.ledger.local_fits import local_efficiency
    from kvledger.ledger.step_model import DEFAULT_EFFICIENCY, StepFeatures, StepTimeModel

    eff = DEFAULT_EFFICIENCY
    if device.name == "local":
        from kvledger.ledger.retention import RetentionSpec

        eff, _ = local_efficiency(device, RetentionSpec())
    model = StepTimeModel(spec, device, eff, kv, tp=tp, block_size=block_size)
    h, b, n = mix.prompt_tokens + mix.output_tokens // 2, max(concurrency, 2), mix.prompt_tokens

    def decodes(k: int) -> float:  # k decodes at context h: one attention call (one length)
        return model.duration(StepFeatures(tokens=k, pairs=k * (h + 1), kv_read_tokens=k * (h + 1),
                                           seqs=k, sampled=k, decode_groups=1))

    one, per_seq = decodes(1), (decodes(b) - decodes(1)) / (b - 1)
    prompt = model.duration(StepFeatures(tokens=n, pairs=n * (n + 1) // 2, kv_read_tokens=n,
                                         seqs=1, sampled=1))
    prices = StepPrices(prefill_token_s=(prompt - one) / max(n - 1, 1),
                        step_s=one - per_seq, decode_seq_s=per_seq)
    return prices, eff.source


def given_prices(text: str) -> StepPrices:
    """``--step-prices``: a JSON object of the prices (seconds, each >= 0; ``request_s`` may be
    left out).

    Raises:
        InvalidParameterError: not JSON, not an object, a key missing or unknown, a value
            that is not a non-negative number, or a zero step.
    """
    try:
        given = json.loads(text)
    except json.JSONDecodeError as exc:
        raise InvalidParameterError(f"--step-prices is not JSON: {exc}") from None
    names = {f.name for f in fields(StepPrices)}
    if not isinstance(given, dict) or not names - {"request_s"} <= set(given) <= names:
        raise InvalidParameterError(f"--step-prices must be an object with the keys "
                                    f"{', '.join(sorted(names))} (request_s may be left out)")
    for name, value in given.items():
        if isinstance(value, bool) or not isinstance(value, int | float) \
                or not math.isfinite(value) or value < 0:
            raise InvalidParameterError(f"--step-prices: {name} must be a number >= 0 "
                                        f"(seconds), got {value!r}")
    if given["step_s"] + given["decode_seq_s"] == 0:
        raise InvalidParameterError("--step-prices: a decode step cannot take no time")
    return StepPrices(**{k: float(v) for k, v in given.items()})


def run(base: Plan, spec: ModelSpec, mix: SharedPrefixMix, replicas: int,
        pool_blocks: int | None, max_num_seqs: int, target_rps: float | None,
        ttft_p90: float | None, json_out: bool, prices_json: str | None = None) -> None:
    """Plan the fleet of replicas sized as ``base`` (or ``pool_blocks``) and print it; priced
    with ``prices_json`` (``--step-prices``) when given, else the replay's step model."""
    o = base.options
    replica = ReplicaSize(pool_blocks or base.pool_blocks, o.block_size, max_num_seqs)
    if prices_json is not None:
        prices, source = given_prices(prices_json), "given (--step-prices)"
    else:
        prices, source = step_prices(spec, base.device, o.kv, mix, replica.concurrency(mix),
                                     o.block_size, o.tp)
    fleet = fleet_plan(mix, replica, prices, replicas, target_rps, ttft_p90)
    if json_out:
        print(json.dumps({**fleet.to_json(), "prices_source": source}, indent=2))
    else:
        render(fleet, base, source)


def _s(value: float | None) -> str:
    return "over capacity" if value is None else f"{value * 1000:.0f} ms"


def render(fleet: FleetPlan, base: Plan, source: str) -> None:
    m, r = fleet.mix, fleet.replica
    console = Console()
    console.print(
        f"[bold]{base.model}[/] on {base.device.name}: {fleet.replicas} replica(s) of "
        f"{r.pool_blocks} KV blocks of {r.block_size} tokens ({r.pool_blocks * base.block_bytes / 2**30:.2f} GiB), "
        f"{fleet.concurrency} requests at once each")
    console.print(
        f"mix: {m.prefixes} shared prefixes of {m.prefix_tokens} tokens, {m.unique_tokens} own "
        f"tokens and {m.output_tokens} output tokens per request"
        + (f", {m.requests} requests" if m.requests else " (steady state)"))
    p = fleet.prices
    console.print(f"step prices: {p.prefill_token_s * 1e3:.3f} ms per prefilled token, "
                  f"{p.step_s * 1e3:.2f} ms per decode step + {p.decode_seq_s * 1e3:.3f} ms per "
                  f"sequence, {p.request_s * 1e3:.1f} ms per request ({source})")
    table = Table(title="Routing")
    for col in ("routing", "prefixes / replica", "hit rate", "service / request",
                "replica req/s", "fleet req/s", "TTFT p50", "TTFT p90", "replicas needed"):
        table.add_column(col, justify="left" if col == "routing" else "right")
    for row in fleet.rows:
        rated = row.rps is not None
        table.add_row(row.routing, str(row.prefixes_per_replica), f"{row.hit_rate:.1%}",
                      _s(row.service_s), f"{row.replica_rps:.2f}", f"{row.fleet_rps:.2f}",
                      _s(row.ttft_p50_s) if rated else "-", _s(row.ttft_p90_s) if rated else "-",
                      "-" if row.replicas_needed is None and fleet.ttft_p90_s is None
                      else str(row.replicas_needed or "none"))
    console.print(table)
    if fleet.target_rps is not None:
        console.print(f"TTFT at {fleet.target_rps:g} requests/s over the fleet"
                      + (f"; replicas needed for TTFT p90 <= {fleet.ttft_p90_s:g} s"
                         if fleet.ttft_p90_s is not None else ""))
