"""The ledger's gate on speculation: how many proposed tokens each sequence verifies this step.

Each step's decision is :func:`kvledger.ledger.speculation.choose_drafts` over

- the acceptance of each proposing sequence: the geometric estimate ``hits / (hits + misses)``
  of its own verifies (a hit: a proposed token accepted; a miss: a verify that rejected one),
  shrunk towards the method's running rate by :data:`PRIOR_WEIGHT` pseudo-verifies, so a new
  request starts at what its method has been reaching. A proposal the gate turned down still
  counts its first token against the token the step emitted (free to measure), so a sequence
  whose acceptance rises gets drafts again;
- the price of the step as planned with those drafts, from the ledger's step model
  (:class:`kvledger.ledger.speculation.VerifyStep`), never from the wall clock: the same step
  and acceptance always get the same drafts, and a busy machine does not move them.

The step model (:func:`step_model`) is the one ``kvledger replay --device local`` prices with:
the ``local`` device ``kvledger probe`` measured (else :data:`ASSUMED_CPU`) and the
full-retention factors ``kvledger probe --steps`` fitted (:mod:`kvledger.ledger.local_fits`),
else :data:`ASSUMED_CPU_EFFICIENCY`, a fit of this project's 2-core Zen 4 (not the replay's
assumed factors, which are a GPU's: a CPU pays far more for a verify's paged pairs and per
sequence).
Only the ratios of step prices matter to the decision, so the device's peaks matter only
through their balance (FLOP per byte).

``gate: false`` in the config verifies every proposal (tests, measurements).
"""

from __future__ import annotations

from kvledger.engine.request import Request
from kvledger.engine.sched.output import ScheduledChunk, SchedulerOutput
from kvledger.ledger.hardware import Device, get_device, local_device_path
from kvledger.ledger.kv_format import KVFormatSpec
from kvledger.ledger.local_fits import FULL, load_fits
from kvledger.ledger.speculation import VerifyStep, choose_drafts
from kvledger.ledger.step_model import Efficiency, StepTimeModel, kept_context
from kvledger.spec import ModelSpec

PRIOR_WEIGHT = 2.0
"""Pseudo-verifies at the method's rate that a request's own acceptance is shrunk towards."""
ASSUMED_CPU = Device("cpu (assumed)", memory_gib=16.0, bandwidth_gbs=30.4, tflops=0.216,
                     source="assumed before `kvledger probe`: this project's 2-core Zen 4 "
                            "(30.4 GB/s in the 2026-12-03 fit, 0.216 TFLOPS bf16 probed)")
"""The device the gate prices steps on before ``kvledger probe`` measured the local one."""
ASSUMED_CPU_EFFICIENCY = Efficiency(
    mfu=0.339, mbu=0.277, step_overhead_s=0.00597, seq_overhead_s=0.000652,
    decode_group_s=0.00369, paged_mfu=0.102, weights_mbu=1.0,
    source="assumed before `kvledger probe --steps`: the 2026-12-03 grid fit of a 2-core Zen 4 "
           "(docs/bench-log/replay.md, fourth batch)")
"""The factors the gate prices steps with before ``kvledger probe --steps`` fitted them."""


def step_model(spec: ModelSpec, kv: KVFormatSpec, block_size: int) -> StepTimeModel:
    """The step model of ``spec`` on this machine (see the module docstring)."""
    device = get_device("local") if local_device_path().is_file() else ASSUMED_CPU
    efficiency = load_fits(device).get(FULL, ASSUMED_CPU_EFFICIENCY)
    return StepTimeModel(spec, device, efficiency, kv, block_size=block_size)


class Gate:
    """Acceptance estimates and the priced decision (see the module docstring).

    Args:
        model: the target's step model (:func:`step_model`).
        draft: the draft model's (method ``draft_model``), None for the lookups.
        enabled: False verifies every proposal.
    """

    def __init__(self, model: StepTimeModel, draft: StepTimeModel | None = None,
                 enabled: bool = True) -> None:
        self.model, self.draft, self.enabled = model, draft, enabled
        self.hits: dict[str, int] = {}
        self.misses: dict[str, int] = {}

    def method_rate(self, method: str) -> float:
        """The method's acceptance over every verify so far (0.5 before any)."""
        h, m = self.hits.get(method, 0), self.misses.get(method, 0)
        return (h + 1) / (h + m + 2)

    def acceptance(self, req: Request, method: str) -> float:
        """``req``'s acceptance estimate for proposals of ``method``."""
        h, m = req.spec_hits, req.spec_misses
        return (h + PRIOR_WEIGHT * self.method_rate(method)) / (h + m + PRIOR_WEIGHT)

    def record(self, req: Request, method: str, accepted: int, rejected: bool) -> None:
        """A verify (or the first token of a gated-off proposal) of ``req``: ``accepted``
        tokens, and whether one was rejected."""
        req.spec_hits += accepted
        req.spec_misses += int(rejected)
        self.hits[method] = self.hits.get(method, 0) + accepted
        self.misses[method] = self.misses.get(method, 0) + int(rejected)

    def price(self, plan: SchedulerOutput, proposing: list[ScheduledChunk]) -> VerifyStep:
        """The price of ``plan`` as a function of the drafts of its ``proposing`` decodes."""
        ids = {id(c) for c in proposing}
        plain, kept = [], []
        for c in plan.chunks:
            if id(c) in ids:
                continue
            spec = c.request.retention.spec
            h = kept_context(spec, c.start, c.request.num_prompt_tokens)
            (kept if spec.evicts else plain).append((h, c.num_new_tokens))
        return VerifyStep(self.model, plain, kept, [c.start for c in proposing],
                          sum(1 for c in plan.chunks if c.samples), self.draft)

    def choose(self, plan: SchedulerOutput, proposing: list[ScheduledChunk],
               acceptance: list[float], available: list[int]) -> list[int]:
        """Tokens each of ``proposing`` verifies this step (all it proposed when the gate is
        off)."""
        if not self.enabled:
            return list(available)
        price = self.price(plan, proposing)
        return choose_drafts(acceptance, available, price.sampled, price)
