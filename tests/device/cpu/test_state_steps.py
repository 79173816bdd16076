"""The native decode steps of the state mixers (kvledger.device.cpu.state_steps) against the
mixers' PyTorch steps (kvledger.model.layers.gated_deltanet / .mamba2, whose formulas
tests/model/layers/test_state_mixers.py holds to transformers): outputs and the states left
behind, at real head sizes (dk = dv = 128, d_state = 128), several sequences of which only some
decode (their rows picked out of the step's state), projections and states in fp32 and bf16
(the engine keeps the states in its compute dtype); for each
vector width the source builds (16 lanes: AVX-512, 8: AVX2, 4: SSE), each compiled apart."""

from __future__ import annotations

import ctypes
import shutil
import subprocess
from importlib import resources
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from kvledger.device.cpu import state_steps
from kvledger.model.layers.gated_deltanet import DeltaNetShape, GatedDeltaNet
from kvledger.model.layers.mamba2 import Mamba2, Mamba2Shape
from kvledger.model.layers.state import LayerState, StateMeta
from kvledger.model.linear import Linear

ARCHES = {"x86-64-v4": 16, "x86-64-v3": 8, "x86-64": 4}
"""-march -> the lanes its build uses."""


def _build(arch: str, folder) -> state_steps.StateStepKernel:
    cxx = shutil.which("c++") or shutil.which("g++")
    if cxx is None:
        pytest.skip("no C++ compiler")
    if arch == "x86-64-v4" and "avx512f" not in Path("/proc/cpuinfo").read_text():
        pytest.skip("no AVX-512 here")
    src = resources.files("kvledger.device.cpu").joinpath("csrc", "state_steps.cpp")
    out = folder / f"state_steps_{arch}.so"
    subprocess.run([cxx, "-O3", f"-march={arch}", "-std=c++17", "-shared", "-fPIC", "-fopenmp",
                    str(src), "-o", str(out)], check=True, capture_output=True, timeout=120)
    return state_steps.StateStepKernel(ctypes.CDLL(str(out)))


@pytest.fixture(scope="module", params=list(ARCHES))
def kernel(request, tmp_path_factory):
    built = _build(request.param, tmp_path_factory.mktemp("state_steps"))
    assert built.lanes == ARCHES[request.param]
    return built


def _linear(out_f: int, in_f: int, dtype, gen) -> Linear:
    return Linear((torch.randn(out_f, in_f, generator=gen) * in_f ** -0.5).to(dtype))


def _mixers(kind: str, kernel, dtype):
    """(ours through PyTorch, ours through ``kernel``) with the same random weights."""
    gen = torch.Generator().manual_seed(0)

    def vec(n, scale=0.5):
        return torch.randn(n, generator=gen) * scale

    if kind == "deltanet":
        s = DeltaNetShape(hidden_size=64, num_k_heads=2, num_v_heads=4, head_k_dim=128,
                          head_v_dim=128)
        args = (s, _linear(s.conv_dim + s.value_dim + 2 * s.num_v_heads, 64, dtype, gen),
                torch.randn(s.conv_dim, s.conv_kernel, generator=gen) * 0.3, vec(4), vec(4),
                (1 + vec(128, 0.1)).to(dtype), _linear(64, s.value_dim, dtype, gen))
        mixers = [GatedDeltaNet(*args, kernels=k) for k in (None, SimpleNamespace(
            state_mixers=lambda: kernel))]
    else:
        s = Mamba2Shape(hidden_size=64, num_heads=4, head_dim=16, d_state=128, n_groups=2,
                        chunk_size=32, dt_max=3.0)
        args = (s, _linear(s.intermediate + s.conv_dim + s.num_heads, 64, dtype, gen),
                torch.randn(s.conv_dim, s.conv_kernel, generator=gen) * 0.3, vec(s.conv_dim),
                vec(4), vec(4), vec(4), (1 + vec(s.intermediate, 0.1)).to(dtype),
                _linear(64, s.intermediate, dtype, gen))
        mixers = [Mamba2(*args, kernels=k) for k in (None, SimpleNamespace(
            state_mixers=lambda: kernel))]
    assert mixers[0].native is None and mixers[1].native is kernel
    return s, mixers


def _run(mixer, steps, state: LayerState) -> list[torch.Tensor]:
    outs = []
    for xs in steps:
        lengths = [x.shape[0] for x in xs]
        starts = torch.tensor([0, *lengths[:-1]]).cumsum(0).tolist()
        meta = StateMeta(tuple(starts), tuple(lengths), (xs is steps[0],) * len(xs))
        outs.append(mixer.forward(torch.cat(xs), state, meta))
    return outs


@pytest.mark.parametrize("state_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kind", ["deltanet", "mamba2"])
def test_native_step_matches_torch(kernel, kind, dtype, state_dtype):
    shape, (torch_mixer, native_mixer) = _mixers(kind, kernel, dtype)
    gen = torch.Generator().manual_seed(1)

    def tokens(n):
        return torch.randn(n, 64, generator=gen).to(dtype)

    steps = [[tokens(40), tokens(7), tokens(3)], [tokens(1), tokens(1), tokens(1)],
             [tokens(1), tokens(9), tokens(1)], [tokens(1), tokens(1), tokens(1)]]
    states = []
    for _ in range(2):
        sizes = shape.state_shapes()
        states.append(LayerState(torch.zeros(3, *sizes["conv"], dtype=state_dtype),
                                 torch.zeros(3, *sizes["recurrent"], dtype=state_dtype)))
    want, got = _run(torch_mixer, steps, states[0]), _run(native_mixer, steps, states[1])
    tol = 1e-5 if torch.bfloat16 not in (dtype, state_dtype) else 2 ** -6
    for w, g in zip(want, got):
        assert torch.allclose(g.float(), w.float(), rtol=tol, atol=tol)
    assert torch.equal(states[1].conv, states[0].conv)  # the inputs, moved
    assert torch.allclose(states[1].recurrent.float(), states[0].recurrent.float(), rtol=tol,
                          atol=tol)


def test_kernel_refuses_what_it_cannot_read():
    native = state_steps.kernel()
    assert native is not None  # g++ is part of this project's machines
    assert not native.accepts_delta(128, native.lanes + 1) and native.accepts_delta(128, 128)
    assert not native.accepts_ssd(native.lanes // 2) and native.accepts_ssd(128)
    fp32, bf16 = torch.zeros(2, 8, 3), torch.zeros(2, 8, 3, dtype=torch.bfloat16)
    cols = torch.zeros(2, 10)[:, 2:6]
    assert native.takes(fp32, fp32, cols) and not native.takes(bf16, fp32, cols)
    assert not native.takes(fp32, fp32, torch.zeros(10, 2).t())
