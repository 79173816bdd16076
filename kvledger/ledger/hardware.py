"""Devices: memory capacity, memory bandwidth and dense bf16 matmul throughput.

Units: ``memory_gib`` in GiB (2**30 bytes; the vendors' "80 GB" of HBM is 80 GiB of DRAM),
``bandwidth_gbs`` in GB/s (10**9 bytes/s, as datasheets quote it), ``tflops`` in dense (not
2:4-sparse) bf16 tensor TFLOPS (10**12 FLOP/s). Every row cites its datasheet.

Three kinds of device: a row of :data:`DEVICES`; ``custom`` built from the user's three numbers;
``local``, measured on this machine by ``kvledger probe`` (:mod:`kvledger.device.measure`)
and saved as JSON in the user's config folder (``$KVLEDGER_CONFIG_DIR`` overrides it). No
torch here.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

from kvledger.errors import ConfigError, InvalidParameterError
from kvledger.paths import config_dir

GiB = 2**30


@dataclass(frozen=True)
class Device:
    """One accelerator (or a CPU host, for ``local``).

    Attributes:
        name: table key (``H100-SXM``) or ``custom`` / ``local``.
        memory_gib: device memory, GiB.
        bandwidth_gbs: peak memory bandwidth, GB/s (10**9 bytes/s).
        tflops: peak dense bf16 matmul throughput, TFLOPS (10**12 FLOP/s).
        source: where the numbers come from (datasheet URL, "user", or "measured").
    """

    name: str
    memory_gib: float
    bandwidth_gbs: float
    tflops: float
    source: str

    @property
    def memory_bytes(self) -> int:
        return int(self.memory_gib * GiB)

    @property
    def bandwidth_bytes_per_s(self) -> float:
        return self.bandwidth_gbs * 1e9

    @property
    def flops_per_s(self) -> float:
        return self.tflops * 1e12


_NV = "https://www.nvidia.com/en-us/data-center/"
_A100 = (
    "https://www.nvidia.com/content/dam/en-zz/Solutions/Data-Center/a100/pdf/"
    "nvidia-a100-datasheet-us-nvidia-1758950-r4-web.pdf"
)
_ADA = "https://images.nvidia.com/aem-dam/Solutions/geforce/ada/nvidia-ada-gpu-architecture.pdf"
_GA102 = (
    "https://www.nvidia.com/content/PDF/nvidia-ampere-ga-102-gpu-architecture-whitepaper-v2.pdf"
)
_MI300X = (
    "https://www.amd.com/content/dam/amd/en/documents/instinct-tech-docs/data-sheets/"
    "amd-instinct-mi300x-data-sheet.pdf"
)
_A10G = "https://www.baseten.co/blog/nvidia-a10-vs-a10g-for-ml-model-inference/"

DEVICES: dict[str, Device] = {
    d.name: d
    for d in (
        # H100 SXM: 80GB HBM3, 3.35TB/s, BF16 1,979 TFLOPS with sparsity -> 989 dense
        Device("H100-SXM", 80, 3350, 989, _NV + "h100/"),
        # same datasheet, H100 PCIe column: 80GB HBM2e, 2TB/s, BF16 1,513 sparse -> 756 dense
        Device("H100-PCIe", 80, 2000, 756, _NV + "h100/"),
        # H200 SXM: 141GB HBM3e, 4.8TB/s, BF16 1,979 sparse -> 989 dense
        Device("H200", 141, 4800, 989, _NV + "h200/"),
        # HGX B200 (8 GPUs): 1.4TB HBM3e -> 180GB each, 64TB/s -> 8TB/s each,
        # FP16/BF16 36 PFLOPS sparse -> 2.25 PFLOPS dense each
        Device("B200", 180, 8000, 2250, _NV + "hgx/"),
        # A100 SXM: 40GB HBM2 1,555GB/s, 80GB HBM2e 2,039GB/s; BF16 312 TFLOPS dense
        Device("A100-40GB", 40, 1555, 312, _A100),
        Device("A100-80GB", 80, 2039, 312, _A100),
        # L40S: 48GB GDDR6, 864GB/s, BF16 733 sparse -> 362.05 dense
        Device("L40S", 48, 864, 362.05, _NV + "l40s/"),
        # L4: 24GB GDDR6, 300GB/s, BF16 242 sparse -> 121 dense
        Device("L4", 24, 300, 121, _NV + "l4/"),
        # A10G (AWS G5; NVIDIA publishes no sheet): 24GB GDDR6, 600GB/s, 70 TFLOPS bf16 tensor
        Device("A10G", 24, 600, 70, _A10G),
        # Ada whitepaper, RTX 4090: 24GB GDDR6X, 1,008GB/s, BF16 (FP32 accumulate) 165.2 dense
        Device("RTX-4090", 24, 1008, 165.2, _ADA),
        # GA102 whitepaper, RTX 3090: 24GB GDDR6X, 936GB/s, BF16 (FP32 accumulate) 71 dense
        Device("RTX-3090", 24, 936, 71, _GA102),
        # MI300X datasheet: 192GB HBM3, 5.3TB/s, BF16 1,307.4 TFLOPS dense
        Device("MI300X", 192, 5300, 1307.4, _MI300X),
    )
}
SPECIAL_DEVICES = ("custom", "local")


def _key(name: str) -> str:
    return name.lower().replace("-", "").replace("_", "").replace(" ", "")


def local_device_path() -> Path:
    """Where ``kvledger probe`` saves the measured ``local`` device."""
    return config_dir() / "local_device.json"


def save_local_device(device: Device) -> Path:
    """Write ``device`` as the ``local`` device; returns the file written."""
    path = local_device_path()
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(asdict(device), indent=2) + "\n")
    return path


def _load_local() -> Device:
    path = local_device_path()
    if not path.is_file():
        raise InvalidParameterError("no local device measured yet: run `kvledger probe` first")
    try:
        return Device(**json.loads(path.read_text()))
    except (json.JSONDecodeError, TypeError) as exc:
        raise ConfigError(f"{path} is corrupt ({exc}); run `kvledger probe` again") from None


def get_device(
    name: str,
    memory_gib: float | None = None,
    bandwidth_gbs: float | None = None,
    tflops: float | None = None,
) -> Device:
    """Resolve a device name (case and dashes ignored), ``custom`` or ``local``.

    For ``custom`` all three numbers are required; for a table device any number given
    overrides the datasheet's (e.g. a 94 GB H100 NVL as ``--device H100-SXM --memory-gib 94``).

    Raises:
        InvalidParameterError: unknown device (the message lists the known ones), a missing or
            non-positive number for ``custom``, or ``local`` before ``kvledger probe``.
    """
    overrides = {"memory_gib": memory_gib, "bandwidth_gbs": bandwidth_gbs, "tflops": tflops}
    for flag, value in overrides.items():
        if value is not None and value <= 0:
            raise InvalidParameterError(f"--{flag.replace('_', '-')} must be positive, got {value}")
    key = _key(name)
    if key == "custom":
        missing = [f"--{k.replace('_', '-')}" for k, v in overrides.items() if v is None]
        if missing:
            raise InvalidParameterError(f"--device custom needs {', '.join(missing)}")
        return Device("custom", memory_gib, bandwidth_gbs, tflops, "user")
    if key == "local":
        base = _load_local()
    else:
        matches = [d for d in DEVICES.values() if _key(d.name) == key]
        if not matches:
            known = ", ".join([*DEVICES, *SPECIAL_DEVICES])
            raise InvalidParameterError(f"unknown device {name!r}; known devices: {known}")
        base = matches[0]
    given = {k: v for k, v in overrides.items() if v is not None}
    if not given:
        return base
    return Device(**{**asdict(base), **given, "source": f"{base.source} (overridden)"})
