"""The gate: acceptance per request shrunk towards its method's rate, and drafts priced with
the ledger's step model (never the wall clock), so k falls to 0 at large batches and low
acceptance."""

from __future__ import annotations

import pytest
from spec_kit import run

from kvledger.engine.request import Request
from kvledger.engine.sample.sampling_params import SamplingParams
from kvledger.engine.sched.output import ScheduledChunk, SchedulerOutput
from kvledger.engine.spec.gate import ASSUMED_CPU, ASSUMED_CPU_EFFICIENCY, Gate, step_model
from kvledger.ledger.hardware import Device, save_local_device
from kvledger.ledger.kv_format import KVFormatSpec
from kvledger.ledger.local_fits import save_fit
from kvledger.ledger.retention import RetentionSpec
from kvledger.ledger.step_model import DEFAULT_EFFICIENCY, Efficiency, StepTimeModel
from kvledger.model.catalogue import load_model_spec

SMOL = load_model_spec("HuggingFaceTB/SmolLM2-135M")
ZEN4 = Device("local", memory_gib=23.5, bandwidth_gbs=30.4, tflops=0.216, source="test")


def test_acceptance_per_request_shrinks_to_the_method_rate():
    gate, a, b = Gate(StepTimeModel(SMOL, ZEN4, DEFAULT_EFFICIENCY)), Request("a", [1]), \
        Request("b", [1])
    gate.record(a, "ngram", accepted=8, rejected=False)  # method: 8 hits, 0 misses
    assert gate.method_rate("ngram") == pytest.approx(9 / 10)
    assert gate.acceptance(a, "ngram") == pytest.approx((8 + 2 * 0.9) / (8 + 2))
    assert gate.acceptance(b, "ngram") == pytest.approx(0.9)  # a new request: the method's
    gate.record(b, "ngram", accepted=0, rejected=True)
    assert gate.acceptance(b, "ngram") < gate.acceptance(a, "ngram")


def _decodes(n: int, context: int = 300) -> tuple[SchedulerOutput, list[ScheduledChunk]]:
    """A step of ``n`` one-token decodes after ``context`` cached tokens."""
    chunks = []
    for i in range(n):
        req = Request(f"r{i}", list(range(context + 1)))
        req.num_computed_tokens = context
        chunks.append(ScheduledChunk(req, 1))
    return SchedulerOutput(chunks=chunks), chunks


@pytest.mark.parametrize(("batch", "acceptance", "drafts"), [
    (1, 0.3, 1), (1, 0.6, 2), (1, 0.9, 5), (4, 0.3, 0), (4, 0.6, 1), (16, 0.6, 0)])
def test_drafts_shrink_with_the_batch_and_the_acceptance(batch, acceptance, drafts):
    """SmolLM2-135M (134.5 M parameters, bf16: 269 MB; 69,120 FLOP per attended pair; 23,040
    KV bytes per token) priced with the Zen 4 fit of docs/bench-log/replay.md (30.4 GB/s,
    0.216 TFLOPS; MFU 0.339, paged pairs 0.102, KV MBU 0.277, 5.97 ms a step, 0.652 ms a
    sequence, 3.69 ms a decode group). By hand, decodes at context 300: a token computes in
    269e6 / 73.2e9 = 3.674 ms, its 301 pairs 0.284 ms, its KV 0.826 ms; the weights read in
    8.85 ms. Batch 1: 23.95 ms for 1 token (0.0418 a ms). One draft: +3.674 ms, its chunk's
    603 pairs paged (1.892 ms) instead of 301 dense, and no decode group left (-3.69 ms):
    25.54 ms for 1.6 tokens (0.0626); two: +3.674 + 0.95 (303 more paged pairs) = 30.17 ms
    for 1.96 (0.0650); three: 34.81 ms for 2.18 (0.0625): two drafts. Batch 16: 105.5 ms
    for 16 tokens (0.1517 a ms); a first draft adds 5.29 ms (the group stays) for 0.6 tokens,
    0.113 a ms: none. The old gate, before it had timed steps, priced a step as 32 tokens'
    compute plus its tokens: at batch 16 and 0.6 it drafted for every sequence (0.6 tokens
    per 1/32 unit against 16 per 1.5 units), which is how concurrency 16 fell to 0.56x."""
    eff = Efficiency(mfu=0.339, mbu=0.277, step_overhead_s=0.00597, seq_overhead_s=0.000652,
                     decode_group_s=0.00369, paged_mfu=0.102, weights_mbu=1.0, source="test")
    gate = Gate(StepTimeModel(SMOL, ZEN4, eff, KVFormatSpec("bf16")))
    plan, chunks = _decodes(batch)
    assert gate.choose(plan, chunks, [acceptance] * batch, [5] * batch) == [drafts] * batch


def _clocked_run(tiny_engine_factory, monkeypatch, seconds) -> dict:
    """Run gated n-gram speculation on repetitive prompts with a fake clock that advances
    ``seconds(tokens)`` over each forward; the engine's speculation counters."""
    clock = [0.0]
    monkeypatch.setattr("time.perf_counter", lambda: clock[0])
    engine = tiny_engine_factory(speculative_config={"method": "ngram"})
    execute = engine.runner.execute

    def timed(chunks, *args):
        clock[0] += seconds(sum(c.num_new_tokens for c in chunks))
        return execute(chunks, *args)

    engine.runner.execute = timed
    prompts = [[5 + i, 6, 7, 8, 9] * 6 for i in range(4)]
    run(engine, prompts, SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True))
    return {k: v for k, v in engine.stats().items() if k.startswith("spec_")}


def test_decisions_do_not_ride_on_the_wall_clock(tiny_engine_factory, monkeypatch, tmp_path):
    """The same requests under a clock where steps cost their weight reads (1 s + 1 us a
    token) and one where they cost their tokens (1 s a token) verify the same drafts. The old
    gate fitted its price on the timed steps: it drafted under the first and not under the
    second."""
    monkeypatch.setenv("KVLEDGER_CONFIG_DIR", str(tmp_path))  # the assumed CPU, not a probe
    weight_bound = _clocked_run(tiny_engine_factory, monkeypatch, lambda t: 1.0 + 1e-6 * t)
    token_bound = _clocked_run(tiny_engine_factory, monkeypatch, lambda t: 1.0 * t)
    assert weight_bound["spec_proposed_tokens"] > 0
    assert token_bound == weight_bound


def test_step_model_is_the_probed_one_or_the_assumed_cpu(monkeypatch, tmp_path):
    monkeypatch.setenv("KVLEDGER_CONFIG_DIR", str(tmp_path))
    assumed = step_model(SMOL, KVFormatSpec("bf16"), 16)
    assert assumed.device == ASSUMED_CPU and assumed.eff.paged_mfu == 0.102
    save_local_device(ZEN4)
    probed = step_model(SMOL, KVFormatSpec("bf16"), 16)
    assert probed.device == ZEN4 and probed.eff == ASSUMED_CPU_EFFICIENCY  # no steps fitted
    fitted = Efficiency(mfu=0.3, mbu=0.2, step_overhead_s=0.004, seq_overhead_s=0.001,
                        source="test fit")
    save_fit(RetentionSpec(), fitted, ZEN4, {})
    assert step_model(SMOL, KVFormatSpec("bf16"), 16).eff.mfu == pytest.approx(0.3)
