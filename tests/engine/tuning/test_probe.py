"""The kernel probe (engine/tuning): cached choices are deterministic, a corrupt cache is ignored,
env forces."""

from __future__ import annotations

import json
import logging

import pytest

from kvledger.device import resolve
from kvledger.engine.tuning import probe as kernel_probe
from kvledger.engine.tuning import timing as probe_timing
from kvledger.errors import InvalidParameterError

CPU = resolve("cpu")


@pytest.fixture
def tiny_spec(tiny_llama):
    from kvledger.model.weights.loader import load_weights

    spec, _ = load_weights(tiny_llama[0])
    return spec


@pytest.fixture(autouse=True)
def own_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("KVLEDGER_CACHE", str(tmp_path))
    monkeypatch.delenv("KVLEDGER_WEIGHT_FORMAT", raising=False)
    monkeypatch.delenv("KVLEDGER_ATTENTION", raising=False)
    monkeypatch.delenv("KVLEDGER_GEMM", raising=False)


def test_probe_measures_every_class_and_backend_then_reads_the_cache(tiny_spec, monkeypatch):
    first = kernel_probe.probe(tiny_spec, CPU)
    assert set(first.matmul_us) == set(kernel_probe.CLASSES)
    assert {"dense", "int8", "w8a8"} <= set(first.matmul_us["qkv"])  # w8a8: native, built here
    assert "reference" in first.attention_us
    assert all(t > 0 for t in first.attention_us.values())
    assert set(first.fused_us) == {f"{op}:{d}" for op in ("add_rms_norm", "silu_mul")
                                   for d in kernel_probe.FUSED_DTYPES}
    assert set(first.fused_us["silu_mul:bf16"]) == {str(r) for r in kernel_probe.FUSED_ROWS}
    assert set(first.gemm_us) == set(kernel_probe.CLASSES) - {"lm_head"}
    assert set(first.gemm_us["qkv"]["int8"]["16"]) == {"own", "fp32", "bf16"}
    assert set(first.gemm_us["qkv"]["dense"]["16"]) == {"own", "fp32"}  # bf16: its own kernel
    assert set(first.quantized_attention_us) == set(first.attention_us)  # same candidates
    assert all(t > 0 for t in first.quantized_attention_us.values())

    def fail(*_):
        raise AssertionError("measured again despite a cached entry")

    monkeypatch.setattr(probe_timing, "time_formats", fail)
    again = kernel_probe.probe(tiny_spec, CPU)
    assert again == first
    assert kernel_probe.choose_formats(tiny_spec, CPU, {"qkv"}) == kernel_probe.choose_formats(
        tiny_spec, CPU, {"qkv"})


def test_choice_is_the_fastest_available_format():
    result = kernel_probe.ProbeResult("cpu", "t", 2, {"qkv": {"dense": 30.0, "int4": 10.0,
                                                         "int8": 20.0}},
                                 {"reference": 5.0, "paged-native": 2.0})
    assert result.weight_format("qkv") == "int4"
    assert result.weight_format("qkv", ("dense", "int8")) == "int8"
    assert result.attention == "paged-native"
    assert result.quantized_attention == "paged-native"  # none timed: the plain choice
    result.quantized_attention_us = {"paged-torch": 9.0, "paged-native": 3.0, "reference": 4.0}
    assert result.quantized_attention == "paged-native"
    result.quantized_attention_us["reference"] = 1.0
    assert result.quantized_attention == "reference"


@pytest.mark.parametrize("kv,want", [("int8", "paged-torch"), ("int4", "paged-torch"),
                                     ("fp8", "paged-torch"), ("fp32", "paged-native")])
def test_engine_takes_the_fastest_backend_measured_for_its_kv_format(tiny_llama, monkeypatch,
                                                                     kv, want):
    """A quantized pool gets the probe's fastest backend over quantized KV, a plain pool the
    fastest over plain blocks (a fake probe where the two differ)."""
    from kvledger.engine.config import EngineConfig
    from kvledger.engine.engine import LLMEngine
    from kvledger.model.weights.loader import load_weights

    spec, weights = load_weights(tiny_llama[0])
    monkeypatch.setattr(kernel_probe, "probe", lambda *_: kernel_probe.ProbeResult(
        "cpu", "t", 1, {}, {"paged-native": 1.0, "paged-torch": 2.0},
        quantized_attention_us={"paged-native": 5.0, "paged-torch": 2.0}))
    engine = LLMEngine(EngineConfig(model=str(tiny_llama[0]), dtype="fp32", kv_cache_dtype=kv),
                       spec=spec, weights=weights)
    assert engine.model.attention.name == want


def test_corrupt_cache_is_ignored_with_a_warning(tiny_spec, caplog):
    path = kernel_probe._cache_file()
    path.parent.mkdir(parents=True)
    path.write_text("{not json")
    with caplog.at_level(logging.WARNING, logger="kvledger.engine"):
        result = kernel_probe.probe(tiny_spec, CPU)
    assert "corrupt" in caplog.text
    assert result.matmul_us
    assert json.loads(path.read_text())  # rewritten


def test_environment_forces_formats_and_backend(tiny_spec, monkeypatch):
    monkeypatch.setenv("KVLEDGER_WEIGHT_FORMAT", "int8")
    monkeypatch.setattr(kernel_probe, "probe", lambda *_: pytest.fail("probe not needed"))
    assert set(kernel_probe.choose_formats(tiny_spec, CPU, set()).values()) == {"int8"}
    monkeypatch.setenv("KVLEDGER_WEIGHT_FORMAT", "qkv=int4, lm_head=dense")
    monkeypatch.setenv("KVLEDGER_ATTENTION", "reference")
    monkeypatch.setattr(kernel_probe, "probe", lambda *_: kernel_probe.ProbeResult(
        "cpu", "t", 1, {c: {"dense": 1.0, "int8": 2.0} for c in kernel_probe.CLASSES}, {}))
    chosen = kernel_probe.choose_formats(tiny_spec, CPU, {"qkv"})
    assert chosen["qkv"] == "int4" and chosen["lm_head"] == "dense" and chosen["o"] == "dense"
    assert kernel_probe.choose_attention(tiny_spec, CPU) == "reference"


def test_bad_forced_format_is_a_clear_error(monkeypatch, tiny_spec):
    monkeypatch.setenv("KVLEDGER_WEIGHT_FORMAT", "qkv=fp4")
    with pytest.raises(InvalidParameterError, match="KVLEDGER_WEIGHT_FORMAT"):
        kernel_probe.forced_formats()
    monkeypatch.setenv("KVLEDGER_ATTENTION", "flash")
    with pytest.raises(InvalidParameterError, match="KVLEDGER_ATTENTION must be one of"):
        kernel_probe.choose_attention(tiny_spec, CPU)


def test_fused_limit_is_the_last_row_count_of_an_unbroken_native_win_or_none():
    t = lambda native, torch_: {"native": native, "torch": torch_}
    result = kernel_probe.ProbeResult("cpu", "t", 2, {}, {}, {
        "silu_mul:bf16": {"1": t(10, 20), "4": t(30, 20), "16": t(40, 80)},  # a loss at 4 ends it
        "silu_mul:fp32": {"1": t(30, 20)},
        "add_rms_norm:bf16": {"1": t(1, 2), "4": t(3, 4), "16": t(5, 6)},
        "add_rms_norm:fp32": {"1": t(1, 2), "4": t(3, 4), "16": t(7, 6)}})
    import torch

    limits = result.fused_max_rows()
    assert limits["silu_mul"] == {torch.bfloat16: 1, torch.float32: 0}
    assert limits["add_rms_norm"] == {torch.float32: 4}  # bf16 won at every count: no limit


def test_native_op_hands_rows_over_its_limit_to_torch(monkeypatch):
    import torch

    from kvledger.device.cpu.fused import NativeOps
    from kvledger.device.cpu.native import library
    from kvledger.device.ops import TorchOps

    lib = library()
    assert lib is not None
    ops = NativeOps(lib, {"silu_mul": {torch.float32: 2}})
    calls = []
    monkeypatch.setattr(TorchOps, "silu_mul", lambda self, x: calls.append(len(x)) or x[:, :1])
    ops.silu_mul(torch.randn(2, 8))  # within the limit: native
    ops.silu_mul(torch.randn(3, 8))  # over it: PyTorch
    ops.silu_mul(torch.randn(3, 8).bfloat16())  # no limit for bf16: native
    assert calls == [3]


def _gemm(own, fp32=None, bf16=None):
    paths = {"fp32": fp32, "bf16": bf16}
    return {"own": own, **{p: t for p, t in paths.items() if t is not None}}


def test_gemm_path_starts_where_it_wins_for_good_and_counts_in_the_format_choice():
    result = kernel_probe.ProbeResult(
        "cpu", "t", 2, {"gate_up": {"dense": 30.0, "int4": 9.0, "int8": 10.0}}, {}, {},
        {"gate_up": {"int8": {"16": _gemm(50, 60), "64": _gemm(200, 150), "256": _gemm(800, 400)},
                     "dense": {"16": _gemm(90, 60), "64": _gemm(300, 310), "256": _gemm(900, 400)},
                     "int4": {"16": _gemm(45), "64": _gemm(190), "256": _gemm(800)}}})
    assert result.gemm_choice("gate_up", "int8") == (64, "fp32")
    assert result.gemm_choice("gate_up", "dense") == (256, "fp32")  # a loss at 64 ends the run
    assert result.gemm_choice("gate_up", "int4") is None
    # 128 decode rows + 2 chunks of 256: int8 10*128 + 2*400 = 2080 < int4 9*128 + 2*800 = 2752
    assert kernel_probe.REFERENCE_REQUEST == (512, 128)
    assert result.weight_format("gate_up") == "int8"


def test_gemm_path_is_the_fastest_at_the_most_rows():
    """bf16 wins at 256 and 64 rows, fp32 only at 16: bf16 from 64 rows; own fastest at the
    top: no path at all, whatever wins below."""
    result = kernel_probe.ProbeResult(
        "cpu", "t", 2, {"o": {"w4a8": 1.0, "int8": 2.0}}, {}, {},
        {"o": {"w4a8": {"16": _gemm(50, 40, 60), "64": _gemm(200, 150, 100),
                        "256": _gemm(800, 400, 300)},
               "int8": {"16": _gemm(50, 40, 30), "64": _gemm(200, 150, 100),
                        "256": _gemm(300, 400, 350)}}})
    assert result.gemm_choice("o", "w4a8") == (64, "bf16")
    assert result.gemm_choice("o", "int8") is None
    # the format choice counts the fastest path of a 256-row chunk: w4a8 128 + 2 * 300
    assert result.weight_format("o") == "w4a8"


def test_forced_gemm_overrides_the_probe(tiny_spec, monkeypatch):
    monkeypatch.setenv("KVLEDGER_GEMM", "bf16")
    assert kernel_probe.forced_gemm() == {c: (64, "bf16") for c in kernel_probe.GEMM_CLASSES}
    monkeypatch.setenv("KVLEDGER_GEMM", "gate_up=fp32:256, down=own")
    assert kernel_probe.forced_gemm() == {"gate_up": (256, "fp32"), "down": None}
    monkeypatch.setenv("KVLEDGER_GEMM", "qkv=bf16,o=bf16:16,gate_up=own,down=fp32")
    chosen = kernel_probe.choose_gemm(tiny_spec, CPU, {"qkv": "int8", "o": "w8a8",
                                                      "gate_up": "dense", "down": "w4a8"})
    assert chosen == {"qkv": (64, "bf16"), "o": (16, "bf16"), "gate_up": None,
                      "down": (64, "fp32")}
    for bad in ("lm_head=bf16", "fp16", "bf16:0", "bf16:x", "qkv=bf16;o=fp32"):
        monkeypatch.setenv("KVLEDGER_GEMM", bad)
        with pytest.raises(InvalidParameterError, match="KVLEDGER_GEMM"):
            kernel_probe.forced_gemm()


@pytest.mark.parametrize("path", ["fp32", "bf16"])
def test_gemm_path_is_the_layers_own_weight(path):
    """Above gemm_rows a layer multiplies on its own weight (int8: codes x the kernel's row
    scales; w8a8: codes x its block scales; w4a8: the Q4 blocks). fp32: the exact product
    rounded once to bf16 (half an ulp, 2^-8 relative). bf16: each weight also rounded once to
    bf16 (2^-8 of it) before an fp32-accumulated product, so the error adds 2^-8 of
    sum |x| |w| (and the fp32 sum's, far smaller)."""
    import torch

    from kvledger.model.linear import Linear, int8_blocks

    gen = torch.Generator().manual_seed(0)
    w = (torch.randn(96, 64, generator=gen) * 0.02).bfloat16()
    x = torch.randn(40, 64, generator=gen).bfloat16()
    bias = torch.randn(96, generator=gen).bfloat16()
    q4 = (torch.randint(0, 16, (96, 64), generator=gen, dtype=torch.uint8),
          torch.rand(96, 2, generator=gen) * 0.01, torch.rand(96, 2, generator=gen) * 0.01)
    for fmt in ("int8", "w8a8", "w4a8", "dense"):
        if fmt == "dense" and path == "bf16":
            continue  # the dense bf16 layer's own kernel
        lin = Linear(w, bias, q4, fmt, kernels=CPU.kernels)
        assert lin.format == fmt
        if fmt == "dense":
            weight = w.float()
        elif fmt == "int8":
            weight = lin.packed.float() * lin.scales.float()[:, None]
        elif fmt == "w8a8":
            codes, scales = int8_blocks(w)  # its codes x block scales (held repacked)
            weight = codes.float() * scales.repeat_interleave(32, 1)
        else:  # the Q4 parts as given: w = (q - 8) * scale + zero
            weight = (q4[0].float() - 8) * q4[1].repeat_interleave(32, 1) \
                + q4[2].repeat_interleave(32, 1)
        exact = x.double() @ weight.double().t() + bias.double()
        terms = x.double().abs() @ weight.double().abs().t()
        rounding = 2 ** -8 * terms if path == "bf16" else 0
        lin.use_gemm(32, path)
        got = lin(x)  # 40 rows >= 32: the GEMM path
        assert got.dtype == torch.bfloat16
        assert bool(((got.double() - exact).abs()
                     <= 2 ** -8 * exact.abs() + rounding + 1e-6).all()), fmt
        own = Linear(w, bias, q4, fmt, kernels=CPU.kernels)
        assert torch.equal(lin(x[:8]), own(x[:8]))  # 8 rows: own kernel
        if fmt != "dense":
            dense = lin.dense_weight(torch.bfloat16).double()  # each weight rounded once
            assert bool(((dense - weight.double()).abs()
                         <= 2 ** -8 * weight.double().abs() + 1e-9).all()), fmt


def test_q4_layer_without_the_native_kernel_keeps_int4_at_every_row_count(monkeypatch):
    """The probe's choice for w4a8 (its GEMM from some rows on) given to a layer built with the
    native library off: the layer is int4, whose packed codes cannot be read back for a GEMM,
    so every row count runs torch's int4 kernel (a prefill used to raise here)."""
    import torch

    from kvledger.device.cpu import native as builder
    from kvledger.device.cpu import w8a8
    from kvledger.model.linear import GROUP, Linear

    gen = torch.Generator().manual_seed(1)
    q4 = (torch.randint(0, 16, (64, 64), generator=gen, dtype=torch.uint8),
          torch.rand(64, 2, generator=gen) * 0.01, torch.rand(64, 2, generator=gen) * 0.01)
    x = torch.randn(40, 64, generator=gen).bfloat16()
    monkeypatch.setenv("KVLEDGER_NATIVE", "0")
    builder.library.cache_clear()
    w8a8.kernel.cache_clear()
    try:
        lin = Linear.from_q4(q4, (64, 64), fmt="w4a8", kernels=CPU.kernels)
        assert lin.format == "int4"
        lin.use_gemm(16, "bf16")
        got = lin(x)  # 40 rows, past the GEMM start the probe gave w4a8
    finally:
        builder.library.cache_clear()
        w8a8.kernel.cache_clear()
    want = torch.ops.aten._weight_int4pack_mm_for_cpu(x, lin.packed, GROUP, lin.scales)
    assert torch.equal(got, want)
    weight = (q4[0].float() - 8) * q4[1].repeat_interleave(32, 1) + q4[2].repeat_interleave(32, 1)
    exact = x.double() @ weight.double().t()  # the Q4 parts as given (gguf's Q4_1 formula)
    assert bool(((got.double() - exact).abs() <= 0.02 * exact.abs().max()).all())
