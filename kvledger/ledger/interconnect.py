"""Tensor-parallel collectives: the link between devices and the time of an all-reduce/gather.

Link bandwidth is per direction, in GB/s (10**9 bytes/s). Vendors quote the *bidirectional
aggregate* of a GPU's links (H100 SXM: "NVLink 900GB/s"), so a rank sends at half that while
it receives at the other half. :data:`LINK_GBS` holds, per device of
:data:`kvledger.ledger.hardware.DEVICES`, the link every pair of ranks in one server has:
NVLink through NVSwitch on the SXM/HGX parts (and AMD's Infinity Fabric mesh on MI300X), the
PCIe slot otherwise (a two-card NVLink bridge links pairs only, so tp > 2 runs over PCIe:
override with ``--link-gbs`` for a bridged pair). ``local`` (ranks as processes on this
machine, gloo over loopback) moves bytes through memory: its link is the probe's measured
memory bandwidth.

Times (bandwidth terms only; per-collective latency, a few microseconds on NVLink, is not
modelled, which makes small decode steps' collectives a lower bound):

  ring all-reduce of S bytes over n ranks  2 (n - 1) / n x S / link
      (each rank sends and receives 2 (n - 1) / n x S: reduce-scatter then all-gather;
      Patarasuk & Yuan, "Bandwidth optimal all-reduce algorithms", JPDC 2009; NCCL's "bus
      bandwidth" of nccl-tests is defined by the same factor)
  gather of n parts of P bytes to rank 0   (n - 1) x P / link   (rank 0 receives them all)
"""

from __future__ import annotations

from kvledger.errors import InvalidParameterError
from kvledger.ledger.hardware import _ADA, _GA102, _MI300X, _NV, Device

_PCIE4 = 32.0  # PCIe Gen4 x16: 64 GB/s bidirectional (the L4 and L40S pages quote it)
_PCIE5 = 64.0  # PCIe Gen5 x16: 128 GB/s bidirectional (the H100 page quotes it)

LINK_GBS: dict[str, tuple[float, str]] = {
    # H100 SXM: "NVIDIA NVLink: 900GB/s" (fourth-generation NVLink through NVSwitch)
    "H100-SXM": (450.0, _NV + "h100/"),
    # H100 PCIe: NVLink bridge 600GB/s pairs two cards; every pair has "PCIe Gen5: 128GB/s"
    "H100-PCIe": (_PCIE5, _NV + "h100/"),
    # H200 SXM: "NVIDIA NVLink: 900GB/s"
    "H200": (450.0, _NV + "h200/"),
    # HGX B200: fifth-generation NVLink, 1.8TB/s per GPU
    "B200": (900.0, _NV + "hgx/"),
    # A100 SXM: "NVIDIA NVLink: 600GB/s" (third generation, through NVSwitch on HGX A100)
    "A100-40GB": (300.0, _NV + "a100/"),
    "A100-80GB": (300.0, _NV + "a100/"),
    # L40S and L4: no NVLink, "PCIe Gen4 x16: 64GB/s bidirectional"
    "L40S": (_PCIE4, _NV + "l40s/"),
    "L4": (_PCIE4, _NV + "l4/"),
    # A10G (AWS G5): no NVLink; PCIe Gen4 x16 assumed (the A10 it derives from has Gen4)
    "A10G": (_PCIE4, _NV + "products/a10-gpu/"),
    # RTX 4090: no NVLink (Ada whitepaper); RTX 3090: a two-card bridge only -> PCIe Gen4
    "RTX-4090": (_PCIE4, _ADA),
    "RTX-3090": (_PCIE4, _GA102),
    # MI300X: 7 Infinity Fabric links to the other GPUs of the platform, 128 GB/s each
    # (bidirectional) = 896 GB/s aggregate
    "MI300X": (448.0, _MI300X),
}


def link_bytes_per_s(device: Device, link_gbs: float | None = None) -> float:
    """Per-direction bytes/s between two ranks on ``device`` (``link_gbs`` overrides).

    Raises:
        InvalidParameterError: ``link_gbs`` <= 0, or a ``custom`` device without it.
    """
    if link_gbs is not None:
        if link_gbs <= 0:
            raise InvalidParameterError(f"--link-gbs must be positive, got {link_gbs}")
        return link_gbs * 1e9
    if device.name == "local":
        return device.bandwidth_bytes_per_s
    if device.name not in LINK_GBS:
        raise InvalidParameterError(
            f"no interconnect bandwidth known for device {device.name!r}: give --link-gbs "
            "(GB/s per direction between two ranks)")
    return LINK_GBS[device.name][0] * 1e9


def all_reduce_s(nbytes: float, ranks: int, link: float) -> float:
    """Seconds of a ring all-reduce of ``nbytes`` over ``ranks`` at ``link`` bytes/s."""
    return 0.0 if ranks <= 1 else 2 * (ranks - 1) / ranks * nbytes / link


def gather_s(part_bytes: float, ranks: int, link: float) -> float:
    """Seconds to gather ``ranks`` parts of ``part_bytes`` on rank 0 at ``link`` bytes/s."""
    return 0.0 if ranks <= 1 else (ranks - 1) * part_bytes / link
