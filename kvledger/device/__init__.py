"""The device seam: what the engine and the model families ask of the hardware they run on.

A device answers what it *has*, never what it would choose (choosing measures the model's
layers and the engine's attention backends, which sit above it: ``kvledger.engine.tuning``):

- :class:`Kernels`: its compiled kernels, each one's handle or None (the caller then takes its
  PyTorch path, so a device without a compiler still runs every model), the fused element-wise
  ops (:class:`kvledger.device.ops.TorchOps` where none are built), and the digest of their
  sources (a new kernel is a new tuning key);
- :class:`Device`: its name, its kernels, its torch device (where the engine puts weights, the
  KV pool, step metadata and logits), whether its choices are measured (``probes``, else
  ``choices``), its identity (what a measurement on it is keyed by),
  how many compute units it grants, and its per-step hook (:meth:`Device.threads`: the CPU's
  thread team, which shrinks while other processes take its CPUs) and the hand-over of its
  workers to another thread (:meth:`Device.release_thread_pool`).

Kernels take plain data (ints, floats, tensors), never an engine or model object, so nothing
here imports ``kvledger.model`` or ``kvledger.engine``. :func:`resolve` turns a name
(``EngineConfig.device``) into the one device object of that name; the CPU is
:mod:`kvledger.device.cpu`, another device is a sibling folder with objects of the same shape
and a row in :data:`DEVICES`.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Protocol, runtime_checkable

from kvledger.errors import InvalidParameterError

if TYPE_CHECKING:
    import torch

    from kvledger.device.ops import TorchOps

DEVICES = {"cpu": "kvledger.device.cpu.device", "cuda": "kvledger.device.cuda.device"}
"""Device name -> the module whose ``DEVICE`` is that device."""


@runtime_checkable
class Kernels(Protocol):
    """A device's compiled kernels: how they are built or loaded, and each one's handle."""

    def library(self) -> object | None:
        """The compiled kernels, built or loaded once; None (logged) when they cannot be."""

    def why_unavailable(self) -> str:
        """Why :meth:`library` is None ('' when it is not)."""

    def source_digest(self) -> str:
        """Short hash of the kernels' sources and build flags (part of every tuning key)."""

    def paged_attention(self) -> object | None:
        """The paged-attention kernel behind the ``paged-native`` backend, or None: that
        backend then runs as ``paged-torch``."""

    def w8a8(self) -> object | None:
        """The int8-activation matmul behind the ``w8a8`` / ``w4a8`` weight formats
        (:mod:`kvledger.model.linear`), or None: those formats then fall back."""

    def int8_weights(self) -> object | None:
        """The product with an ``int8`` weight (:mod:`kvledger.model.linear`: ``(x, codes,
        row scales) -> x @ (codes x scales)^T``) where the device has its own, or None: the
        ``int8`` format multiplies with ``aten._weight_int8pack_mm`` (the CPU's)."""

    def kquant(self) -> object | None:
        """The products with weights in a GGUF's own blocks behind the ``kquant-*`` weight
        formats (:mod:`kvledger.model.kquant`), and their dequantization, or None: those
        formats then dequantize in PyTorch."""

    def kv_encoder(self) -> object | None:
        """The int8 / int4 KV block encoder (``encode_into``: a block's bytes written at block
        ids in one call, from the codec's numbers), or None: the codecs' PyTorch code
        encodes."""

    def state_mixers(self) -> object | None:
        """The decode steps of the state mixers (the conv update and the recurrent update of
        gated DeltaNet and Mamba-2, :mod:`kvledger.model.layers.gated_deltanet` /
        :mod:`~kvledger.model.layers.mamba2`), or None: the mixers then step in PyTorch."""

    def fused_ops(self, max_rows: dict | None = None) -> TorchOps:
        """The fused element-wise ops, each taking at most ``max_rows`` (op -> dtype -> rows)
        and leaving more to the PyTorch ones; the PyTorch ones where none are built."""


@runtime_checkable
class StepHook(Protocol):
    """What a device does before each engine step, in the thread that steps."""

    def before_step(self) -> None:
        """Adjust the device's workers to this moment (the CPU: its thread team's size)."""


@runtime_checkable
class Device(Protocol):
    """What the engine and a model family ask of the device they run on."""

    name: str
    kernels: Kernels
    torch_device: torch.device
    """Where the engine's tensors live (the CPU's: ``cpu``; the CUDA device's: its GPU)."""
    probes: bool
    """Whether the engine's choices (attention backend, weight formats, GEMM paths, fused-op
    limits) are measured on it (``kvledger.engine.tuning.probe``); else :attr:`choices`."""
    choices: dict[str, str]
    """Where it does not probe: ``attention`` (a backend name) and ``weight_format``."""

    def unavailable(self) -> str:
        """Why this machine cannot run the device ('' when it can)."""

    def identity(self) -> str:
        """The hardware's model and features: a measurement made on it is keyed by this."""

    def compute_units(self) -> int:
        """The compute units this process may use (the CPU: its cores, after the cgroup
        quota)."""

    def threads(self, requested: int | None, ranks: int = 1) -> StepHook:
        """Start computing in the calling thread with ``requested`` workers (None: what the
        device grants, shared by ``ranks`` tensor-parallel ranks); the returned hook runs
        before each step."""

    def release_thread_pool(self) -> bool:
        """Free the calling thread's workers before another thread takes over the computing;
        True when something was freed."""


def resolve(name: str) -> Device:
    """The device called ``name`` (a key of :data:`DEVICES`).

    Raises:
        InvalidParameterError: an unknown device, or one this machine cannot run.
    """
    if name not in DEVICES:
        raise InvalidParameterError(f"device must be one of {', '.join(DEVICES)}, got {name!r}")
    device = importlib.import_module(DEVICES[name]).DEVICE
    why = device.unavailable()
    if why:
        raise InvalidParameterError(f"device {name!r} is not available here: {why}")
    return device
