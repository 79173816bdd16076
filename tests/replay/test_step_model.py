"""The step-time model's features and durations, and the fit of its factors."""

from __future__ import annotations

import random

import pytest

from kvledger.errors import InvalidParameterError
from kvledger.ledger.hardware import get_device
from kvledger.ledger.kv_format import KVFormatSpec
from kvledger.ledger.step_model import Efficiency, StepFeatures, StepTimeModel
from kvledger.model.catalogue import load_model_spec
from kvledger.replay.fit import FIT_WEIGHTS_MBU, fit

LLAMA_8B_PARAMS = 8_030_261_248  # model card: 8.03B (count of meta-llama/Llama-3.1-8B)
LLAMA_8B_KV_BYTES = 131_072  # 32 layers x 2 (K, V) x 8 KV heads x 128 x 2 bytes (bf16)


def test_features_by_hand():
    f = StepFeatures.of([(0, 4), (10, 1)])
    # pairs: 4 new tokens from 0 see 1+2+3+4 = 10 keys; 1 token at 10 sees 11
    assert f == StepFeatures(tokens=5, pairs=21, kv_read_tokens=15, seqs=2, sampled=2,
                             decode_groups=1, paged_pairs=0)


def test_decode_groups_and_paged_pairs_by_hand():
    """Decodes at contexts 10, 12, 13, 14, 40, 50, 51: a group takes a context up to 1.25 x
    (its first + 1): 10 -> up to 13.75 (10, 12, 13), 14 -> 18.75 (14), 40 -> 51.25 (40, 50,
    51): 3 groups. A 3-token chunk after 20 cached tokens attends 3 x 20 + 6 = 66 pairs through
    the paged kernel; one from position 0 and a one-token chunk at 0 none. Under an evicting
    policy every decode is a group of its own and nothing is paged."""
    decodes = [(h, 1) for h in (51, 10, 13, 40, 12, 14, 50)]
    f = StepFeatures.of([*decodes, (20, 3), (0, 5), (0, 1)])
    assert (f.decode_groups, f.paged_pairs, f.seqs) == (4 - 1, 66, 10)
    kept = StepFeatures.of([*decodes, (20, 3)], evicting=True)
    assert (kept.decode_groups, kept.paged_pairs, kept.pairs) == (7, 0, f.pairs - 15 - 1)


def test_decode_step_on_h100_by_hand():
    spec = load_model_spec("meta-llama/Llama-3.1-8B")
    h100 = get_device("H100-SXM")  # 989 TFLOPS dense bf16, 3350 GB/s
    eff = Efficiency(mfu=0.5, mbu=0.8, step_overhead_s=0.001, seq_overhead_s=0.0001, source="t")
    model = StepTimeModel(spec, h100, eff, KVFormatSpec("bf16"), "bf16")
    f = StepFeatures.of([(1023, 1)])  # one decode at context 1023
    flops = 2 * LLAMA_8B_PARAMS + 32 * 2 * 32 * 256 * 1024  # weights + QK/PV over 1024 keys
    bytes_ = 2 * LLAMA_8B_PARAMS + LLAMA_8B_KV_BYTES * (1024 + 1)  # weights, KV read + write
    expected = 0.001 + 0.0001 + flops / 989e12 / 0.5 + bytes_ / 3350e9 / 0.8
    assert model.duration(f) == pytest.approx(expected, rel=1e-9)
    # tensor parallel: half the FLOPs and bytes per rank (8 KV heads split over 2)
    tp2 = StepTimeModel(spec, h100, eff, KVFormatSpec("bf16"), "bf16", tp=2)
    assert tp2.terms(f)[0] == pytest.approx(model.terms(f)[0] / 2)
    assert tp2.terms(f)[1] == pytest.approx(model.terms(f)[1] / 2)


def test_tensor_parallel_collectives_on_h100_by_hand():
    """Llama-3.1-8B (config.json: hidden 4096, 32 layers, vocab 128256) at TP 2 over H100 SXM
    NVLink (900 GB/s bidirectional -> 450e9 B/s per direction), a decode batch of 8 in bf16:
    two ring all-reduces per layer of 4096 x 8 x 2 bytes (2 (n-1)/n = 1 at n = 2) and the gather
    of rank 1's 8 x 64128 bf16 logits on rank 0."""
    spec = load_model_spec("meta-llama/Llama-3.1-8B")
    h100 = get_device("H100-SXM")
    eff = Efficiency(mfu=0.5, mbu=0.8, step_overhead_s=0.0, seq_overhead_s=0.0, source="t")
    f = StepFeatures.of([(100 + i, 1) for i in range(8)])
    reduce = 4096 * 8 * 2 / 450e9
    gather = 8 * 64128 * 2 / 450e9
    tp2 = StepTimeModel(spec, h100, eff, KVFormatSpec("bf16"), "bf16", tp=2)
    assert tp2.collective_s(f) == pytest.approx(64 * reduce + gather, rel=1e-12)
    compute, memory = tp2.terms(f)
    assert tp2.duration(f) == pytest.approx(compute / 0.5 + memory / 0.8 + 64 * reduce + gather)
    # TP 4: ring factor 2 x 3 / 4, three parts of ceil(128256 / 4) = 32064 logits gathered
    tp4 = StepTimeModel(spec, h100, eff, KVFormatSpec("bf16"), "bf16", tp=4)
    assert tp4.collective_s(f) == pytest.approx(64 * 1.5 * reduce + 3 * 8 * 32064 * 2 / 450e9)
    assert StepTimeModel(spec, h100, eff, KVFormatSpec("bf16"), "bf16").collective_s(f) == 0
    # a 16-token prefill chunk that does not end its prompt samples nothing: no logits
    mid = StepFeatures.of([(0, 16)], sampled=0)
    assert tp2.collective_s(mid) == pytest.approx(64 * 4096 * 16 * 2 / 450e9)
    # the link override and a device with no known link
    slow = StepTimeModel(spec, h100, eff, KVFormatSpec("bf16"), "bf16", tp=2, link_gbs=45)
    assert slow.collective_s(f) == pytest.approx(10 * tp2.collective_s(f))
    custom = get_device("custom", 80, 3000, 900)
    with pytest.raises(InvalidParameterError, match="--link-gbs"):
        StepTimeModel(spec, custom, eff, tp=2)


def test_every_table_device_has_a_link():
    from kvledger.ledger.hardware import DEVICES
    from kvledger.ledger.interconnect import LINK_GBS

    assert set(LINK_GBS) == set(DEVICES)


def _random_steps(rng: random.Random) -> list[list[tuple[int, int]]]:
    """40 steps of 1-29 chunks (context 0-1999; 1, 64 or 512 new tokens)."""
    return [[(rng.randrange(0, 2000), rng.choice([1, 1, 1, 64, 512]))
             for _ in range(rng.randrange(1, 30))] for _ in range(40)]


def test_fit_recovers_known_factors():
    spec = load_model_spec("default")
    dev = get_device("L4")
    truth = Efficiency(mfu=0.3, mbu=0.6, step_overhead_s=0.004, seq_overhead_s=0.0002, source="",
                       decode_group_s=0.003, paged_mfu=0.05, weights_mbu=FIT_WEIGHTS_MBU)
    model = StepTimeModel(spec, dev, truth)
    samples = [(f, model.duration(f)) for f in map(StepFeatures.of,
                                                   _random_steps(random.Random(0)))]
    got, stats = fit(samples, model, "test")
    assert got.mfu == pytest.approx(0.3, rel=1e-6)
    assert got.mbu == pytest.approx(0.6, rel=1e-6)
    assert got.step_overhead_s == pytest.approx(0.004, rel=1e-6)
    assert got.seq_overhead_s == pytest.approx(0.0002, rel=1e-6)
    assert got.decode_group_s == pytest.approx(0.003, rel=1e-6)
    assert got.paged_mfu == pytest.approx(0.05, rel=1e-6)
    assert got.weights_mbu == FIT_WEIGHTS_MBU
    assert stats["median_rel_error"] < 1e-9
    with pytest.raises(ValueError, match="at least 6"):
        fit(samples[:5], model, "test")
    # steps with no paged pairs: paged_mfu not measured (priced at mfu), the rest recovered
    plain = [StepFeatures.of([(h if n == 1 else 0, n) for h, n in chunks])
             for chunks in _random_steps(random.Random(1))]
    got, _ = fit([(f, model.duration(f)) for f in plain], model, "test")
    assert got.paged_mfu is None
    assert got.mbu == pytest.approx(0.6, rel=1e-6)


def test_weights_and_paged_pairs_priced_apart_on_l4_by_hand():
    """SmolLM2-135M on an L4 (121 TFLOPS bf16, 300 GB/s): a step of one decode at context 99
    and a 10-token chunk after 50 cached tokens. Params 134,515,008 (config.json: 30 layers,
    hidden 576, MLP 1536, 9 heads / 3 KV heads of 64, vocab 49152, tied embeddings); attention
    4 x 30 x 9 x 64 = 69,120 FLOPs per pair; KV 2 x 30 x 3 x 64 x 2 = 23,040 bytes per token."""
    spec = load_model_spec("HuggingFaceTB/SmolLM2-135M")
    l4 = get_device("L4")
    eff = Efficiency(mfu=0.5, mbu=0.4, step_overhead_s=0.001, seq_overhead_s=0.0001, source="t",
                     decode_group_s=0.002, paged_mfu=0.1, weights_mbu=0.8)
    f = StepFeatures.of([(99, 1), (50, 10)])
    paged_pairs = 10 * 50 + 55
    dense = 2 * 134_515_008 * 11 + 69_120 * 100
    bytes_kv = 23_040 * (100 + 60 + 11)
    bytes_w = 2 * 134_515_008
    expected = (0.001 + 0.0002 + 0.002 + dense / 121e12 / 0.5
                + 69_120 * paged_pairs / 121e12 / 0.1 + bytes_w / 300e9 / 0.8
                + bytes_kv / 300e9 / 0.4)
    model = StepTimeModel(spec, l4, eff, KVFormatSpec("bf16"), "bf16")
    assert model.duration(f) == pytest.approx(expected, rel=1e-9)
    # None: the paged pairs at mfu, the weights at mbu (the ledger's two terms)
    plain = Efficiency(mfu=0.5, mbu=0.4, step_overhead_s=0.0, seq_overhead_s=0.0, source="t")
    compute, memory = model.terms(f)
    plain_model = StepTimeModel(spec, l4, plain, KVFormatSpec("bf16"), "bf16")
    assert plain_model.duration(f) == pytest.approx(compute / 0.5 + memory / 0.4, rel=1e-12)



def _trace(steps, prompts, sampling=None):
    from kvledger.replay.trace import Trace, TraceRequest

    return Trace({}, [TraceRequest(rid, 0.0, n, sampling=(sampling or {}).get(rid, {}))
                      for rid, n in prompts.items()], steps=steps)


def test_samples_from_trace_use_the_step_period_while_busy():
    from kvledger.ledger.retention import RetentionSpec
    from kvledger.replay.fit import samples_from_trace

    steps = [{"start_s": 1.0, "duration_s": 0.2, "chunks": [["a", 0, 8]]},
             {"start_s": 1.25, "duration_s": 0.1, "chunks": [["a", 8, 1], ["b", 0, 4]]},
             {"start_s": 5.0, "duration_s": 0.3, "chunks": [["c", 0, 2]]}]
    got = samples_from_trace(_trace(steps, {"a": 8, "b": 4, "c": 2}), RetentionSpec())
    assert [round(t, 9) for _, t in got] == [0.25, 0.1, 0.3]  # busy: start to start; idle after
    assert got[1][0] == StepFeatures(tokens=5, pairs=9 + 10, kv_read_tokens=13, seqs=2,
                                     sampled=2, decode_groups=1)


def test_samples_from_trace_under_a_policy_count_the_kept_tokens():
    """sinks 4 + 12 (capacity 16): a decode at position 100 attends the 15 held tokens and
    itself; a snapkv-compressed prompt of 100 tokens to budget 40 holds 40 + the 5 tokens
    generated since at position 105; a step running a request that named another policy is
    not a sample of this one."""
    from kvledger.ledger.retention import RetentionSpec
    from kvledger.replay.fit import samples_from_trace

    sinks = RetentionSpec("sinks", window=12, sinks=4)
    steps = [{"start_s": 0.0, "duration_s": 0.1, "chunks": [["a", 100, 1], ["b", 8, 1]]},
             {"start_s": 1.0, "duration_s": 0.1, "chunks": [["a", 101, 1], ["own", 50, 1]]}]
    trace = _trace(steps, {"a": 90, "b": 5, "own": 40},
                   {"own": {"kv_policy": {"policy": "window", "window": 8}}})
    (got,) = samples_from_trace(trace, sinks)
    assert got[0] == StepFeatures(tokens=2, pairs=16 + 9, kv_read_tokens=16 + 9, seqs=2,
                                  sampled=2, decode_groups=2)
    snap = RetentionSpec("snapkv", budget=40)
    steps = [{"start_s": 0.0, "duration_s": 0.1, "chunks": [["p", 105, 1]]}]
    (got,) = samples_from_trace(_trace(steps, {"p": 100}), snap)
    assert got[0].kv_read_tokens == 40 + 5 + 1


def test_groups_and_paged_pairs_are_the_engines_attention_calls(tiny_engine):
    """Every step of a probe grid with spread-length batches and prefix hits (measure_steps):
    ``decode_groups`` is the number of decode groups the runner builds (one attention call
    per layer each) and ``paged_pairs`` the (query, key) pairs its masks let the prefill
    segments after cached tokens attend; some steps have several groups, some paged pairs."""
    from kvledger.replay.fit import measure_steps

    engine = tiny_engine(num_blocks=400, max_num_seqs=8, max_num_batched_tokens=48)
    batch = engine.runner.batch
    calls = []  # (decode groups, paged pairs) of each step the runner ran

    def spy(chunks):
        out = batch(chunks)
        meta = out[2]
        calls.append((len(meta.decodes), sum(int(s.mask.sum()) for s in meta.prefills
                                             if s.slots is not None and not s.gathered)))
        return out

    engine.runner.batch = spy
    samples = measure_steps(engine, ((9, 2),), 3, mixed=((5, 12, 30, 70),),
                            prefixed=((16, (6, 40)),))
    assert [(f.decode_groups, f.paged_pairs) for f, _ in samples] == calls
    assert max(g for g, _ in calls) >= 3 and sum(p for _, p in calls) > 0
