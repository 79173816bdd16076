"""The CUDA device behind the seam: ``resolve("cuda")`` and ``kvledger generate --device cuda``
refuse it with a user error where torch sees no GPU; it has the protocols' shape; without triton
every kernel is None; and its kernels behind the engine's seams (``paged-native`` over a KV
store, the quantized store's int encoder) give what the CPU paths give (the interpreter here)."""

from __future__ import annotations

import importlib
import importlib.util

import pytest
import torch
from typer.testing import CliRunner

from kvledger.device import Device, Kernels, StepHook, resolve
from kvledger.device.cuda.device import DEVICE
from kvledger.device.cuda.kernels import CudaKernels
from kvledger.engine.attention import AttentionMetadata, PrefillSegment, make_backend
from kvledger.engine.attention.layer import LayerAttention
from kvledger.engine.kv.codecs import make_codecs
from kvledger.engine.kv.quantized_store import QuantizedKVStore
from kvledger.engine.kv.store import KVStore
from kvledger.engine.runner import _decode_group, _prefix_causal_mask
from kvledger.errors import InvalidParameterError

NO_GPU = pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a CUDA GPU")
TRITON = pytest.mark.skipif(importlib.util.find_spec("triton") is None,
                            reason="triton is not installed (pip install -e '.[cuda]')")
# these seam tests build their KV stores on the CPU (no device given): on a GPU machine the
# kernels would not take them; the engine's own run on a GPU is test_cuda_engine.py's
INTERPRETER = pytest.mark.skipif(torch.cuda.is_available(),
                                 reason="the KV stores are CPU-only: the seams run interpreted")
BLOCK = 4


@NO_GPU
def test_resolving_cuda_without_a_gpu_is_a_user_error_that_says_why():
    with pytest.raises(InvalidParameterError, match="device 'cuda' is not available here: "
                                                    "torch .* sees no CUDA GPU; use --device cpu"):
        resolve("cuda")


@NO_GPU
def test_generate_on_cuda_without_a_gpu_exits_2_with_one_error_line():
    from kvledger.cli import app

    r = CliRunner().invoke(app, ["generate", "--device", "cuda", "hello"])
    assert r.exit_code == 2, r.output
    assert "Traceback" not in r.output
    errors = [line for line in r.output.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "sees no CUDA GPU" in errors[0], r.output


def test_the_cuda_device_has_the_protocols_shape():
    assert isinstance(DEVICE, Device) and isinstance(DEVICE.kernels, Kernels)
    assert DEVICE.name == "cuda" and DEVICE.compute_units() >= 1
    assert isinstance(DEVICE.threads(None), StepHook) and DEVICE.release_thread_pool() is False
    assert DEVICE.kernels.w8a8() is None and DEVICE.kernels.kquant() is None
    assert DEVICE.kernels.fused_ops().name == "torch"
    assert len(DEVICE.kernels.source_digest()) == 16


def test_without_triton_every_kernel_is_none_and_a_gpu_machine_says_so(monkeypatch):
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    kernels = CudaKernels()
    assert kernels.library() is None and "pip install -e '.[cuda]'" in kernels.why_unavailable()
    assert kernels.paged_attention() is None and kernels.kv_encoder() is None
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert DEVICE.unavailable() == "triton is not installed (pip install -e '.[cuda]')"



def _store(heads=2, dim=16, blocks=24):
    store = KVStore(1, blocks, BLOCK, heads, dim, torch.float32)
    g = torch.Generator().manual_seed(0)
    for t in (store.key_blocks[0], store.value_blocks[0]):
        t.copy_(torch.randn(t.shape, generator=g))
    return store


def _slots(table, length):
    return (torch.tensor(table)[:, None] * BLOCK + torch.arange(BLOCK)).flatten()[:length]


LAYERS = [LayerAttention(0.25), LayerAttention(0.3, window=6),
          LayerAttention(0.25, sinks=torch.tensor([0.5, -1.0, 2.0, 0.0])),
          LayerAttention(0.5, window=6, softcap=2.0)]
"""The soft-capped layer (Gemma 2) is passed to the kernel too: before, paged-native handed it
to paged-torch and the kernel was never called."""


@TRITON
@INTERPRETER
@pytest.mark.triton
@pytest.mark.parametrize("how", LAYERS, ids=["plain", "window", "sinks", "soft-cap"])
def test_paged_native_on_the_cuda_kernels_matches_the_reference_backend(how, monkeypatch, count_calls):
    store, kernels = _store(), CudaKernels(lambda: 4)
    calls = count_calls("paged_attention", "paged_attention")
    tables, lengths = [[5, 17, 2, 9, 11], [3], [20, 0]], [19, 2, 8]
    group = _decode_group(0, [_slots(t, n) for t, n in zip(tables, lengths)])
    seg = PrefillSegment(0, 3, _slots([7, 1, 14, 22], 14), _prefix_causal_mask(11, 3))
    q = torch.randn(3, 4, 16, generator=torch.Generator().manual_seed(1))
    empty = torch.empty(0, 2, 16)
    for meta in (AttentionMetadata(None, decodes=[group]), AttentionMetadata(None, prefills=[seg])):
        outs = []
        for name in ("reference", "paged-native"):
            backend = make_backend(name, kernels)
            backend.set_layers([how])
            outs.append(backend(0, q, empty, empty, meta, store))
        torch.testing.assert_close(outs[1], outs[0], atol=1e-5, rtol=1e-5)
    assert calls == [1, 1], "the Triton kernel did not attend"
    assert make_backend("paged-native", kernels).reader(store) == "paged-native"


@TRITON
@INTERPRETER
@pytest.mark.triton
@pytest.mark.parametrize("fmt", ["int8", "int4", "int2", "int3"])  # int3: the PyTorch codec
def test_the_quantized_store_holds_the_same_pool_with_the_triton_encoder(fmt, monkeypatch, count_calls):
    calls = count_calls("kv_int", "encode_into")
    bs, heads, dim = 4, 2, 16
    channels = torch.tensor([[[3, 9], [7, 8]]])  # outlier key channels of the one layer
    keys, values = make_codecs(fmt, bs, heads, dim, 8, "per-channel", channels)
    stores = [QuantizedKVStore(1, 9, bs, heads, dim, fmt, keys, values, torch.float32,
                               residual_slots=3, kernels=kernels)
              for kernels in (CudaKernels(), None)]
    gen = torch.Generator().manual_seed(2)
    steps = [torch.cat([torch.arange(0, 6), torch.arange(12, 16), torch.arange(24, 27)])]
    steps += [torch.tensor([6 + t, 16 + t, 27 + t]) for t in range(6)]
    for slots in steps:
        k = torch.randn(len(slots), heads, dim, generator=gen)
        v = torch.randn(len(slots), heads, dim, generator=gen)
        for store in stores:
            store.write(0, slots, k, v)
    fast, slow = stores
    for side in ("key_parts", "value_parts"):
        for name, tensor in getattr(fast, side)[0].items():
            assert torch.equal(tensor, getattr(slow, side)[0][name]), (side, name)
    assert bool(calls) == (fmt != "int3"), "the Triton encoder ran or not as its shapes allow"


@NO_GPU
def test_probe_on_cuda_without_a_gpu_refuses_before_measuring_or_saving(tmp_path, monkeypatch):
    from kvledger.cli import app

    monkeypatch.setenv("KVLEDGER_CONFIG_DIR", str(tmp_path))
    r = CliRunner().invoke(app, ["probe", "--device", "cuda"])
    assert r.exit_code == 2 and "sees no CUDA GPU" in r.output, r.output
    assert "local device:" not in r.output and list(tmp_path.iterdir()) == []


@TRITON
@INTERPRETER
@pytest.mark.triton
@pytest.mark.parametrize("fmt,rotated,softcap", [("int8", False, None), ("int4", True, 2.0),
                                                 ("int2", False, None), ("fp8", False, 2.0),
                                                 ("fp8", True, None)])
def test_paged_native_reads_a_quantized_pool_as_the_reference_backend(fmt, rotated, softcap,
                                                                      monkeypatch, count_calls):
    from kvledger.engine.kv.rotation import hadamard

    bs, heads, dim = 4, 2, 16
    keys, values = make_codecs(fmt, bs, heads, dim, 8, "per-channel")
    store = QuantizedKVStore(1, 12, bs, heads, dim, fmt, keys, values, torch.float32,
                             residual_slots=3, rotation=hadamard(dim) if rotated else None)
    gen = torch.Generator().manual_seed(3)
    # sequence 0 owns blocks 0-3 (13 tokens: the last block unsealed, in a residual buffer),
    # sequence 1 blocks 8-9 (8 tokens, both sealed)
    slots = torch.cat([torch.arange(0, 13), torch.arange(32, 40)])
    store.write(0, slots, torch.randn(21, heads, dim, generator=gen),
                torch.randn(21, heads, dim, generator=gen))
    assert int((store.residual_of >= 0).sum()) >= 1, "no block read from a residual buffer"
    kernels, calls = CudaKernels(lambda: 4), count_calls("paged_attention",
                                                     "paged_attention_quantized")
    group = _decode_group(0, [torch.arange(0, 13), torch.arange(32, 40)])
    meta = AttentionMetadata(None, decodes=[group])
    q = torch.randn(2, 4, dim, generator=gen)
    empty = torch.empty(0, heads, dim)
    how = [LayerAttention(0.3, sinks=torch.tensor([0.5, -1.0, 2.0, 0.0]), softcap=softcap)]
    outs = []
    for name in ("reference", "paged-native"):
        backend = make_backend(name, kernels)
        backend.set_layers(how)
        outs.append(backend(0, q, empty, empty, meta, store))
    torch.testing.assert_close(outs[1], outs[0], atol=1e-5, rtol=1e-5)
    assert calls == [1] and make_backend("paged-native", kernels).reader(store) == "paged-native"


@TRITON
@pytest.mark.parametrize("fmt,dim,outliers", [("int3", 16, False), ("int8", 24, False),
                                              ("fp8", 24, False), ("int8", 16, True)])
def test_a_pool_the_kernel_does_not_read_is_handed_to_paged_torch(fmt, dim, outliers):
    """int3, a head_dim not a power of two, outlier key channels."""
    channels = torch.tensor([[[3, 9], [7, 8]]]) if outliers else None
    keys, values = make_codecs(fmt, 4, 2, dim, 8, "per-channel", channels)
    store = QuantizedKVStore(1, 4, 4, 2, dim, fmt, keys, values, torch.float32,
                             residual_slots=1)
    reader = make_backend("paged-native", CudaKernels()).reader(store)
    assert reader == "paged-native (paged-torch: 1 of 1 layers)"


@TRITON
def test_an_fp8_pool_on_a_gpu_before_sm89_is_handed_to_paged_torch(monkeypatch):
    import kvledger.device.cuda.kernels as cuda_kernels

    keys, values = make_codecs("fp8", 4, 2, 16, 8, "per-channel")
    store = QuantizedKVStore(1, 4, 4, 2, 16, "fp8", keys, values, torch.float32, 1)
    backend = make_backend("paged-native", CudaKernels())
    assert backend.reader(store) == "paged-native"
    monkeypatch.setattr(cuda_kernels, "fp8_capable", lambda t: False)  # an A100's answer
    backend = make_backend("paged-native", CudaKernels())
    assert backend.reader(store) == "paged-native (paged-torch: 1 of 1 layers)"
