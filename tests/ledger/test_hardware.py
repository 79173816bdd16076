"""Device table, custom devices, and the saved ``local`` device."""

from __future__ import annotations

import pytest

from kvledger.errors import InvalidParameterError
from kvledger.ledger.hardware import DEVICES, Device, get_device, save_local_device

REQUIRED = (
    "H100-SXM",
    "H100-PCIe",
    "H200",
    "B200",
    "A100-40GB",
    "A100-80GB",
    "L40S",
    "L4",
    "A10G",
    "RTX-4090",
    "RTX-3090",
    "MI300X",
)


def test_every_required_device_has_a_cited_source():
    assert set(REQUIRED) <= set(DEVICES)
    for d in DEVICES.values():
        assert d.source.startswith("https://"), d.name
        assert d.memory_gib > 0 and d.bandwidth_gbs > 0 and d.tflops > 0


def test_datasheet_figures_spot_check():
    """H100 SXM datasheet: 80 GB, 3.35 TB/s, 1,979 bf16 TFLOPS with sparsity (989 dense)."""
    h100 = get_device("h100-sxm")
    assert (h100.memory_gib, h100.bandwidth_gbs, h100.tflops) == (80, 3350, 989)
    assert h100.memory_bytes == 80 * 2**30
    assert h100.bandwidth_bytes_per_s == 3.35e12


def test_lookup_ignores_case_and_dashes():
    assert get_device("rtx4090").name == "RTX-4090"
    assert get_device("A100_80gb").name == "A100-80GB"


def test_unknown_device_lists_the_known_ones():
    with pytest.raises(InvalidParameterError, match="known devices: H100-SXM.*custom, local"):
        get_device("TPU-v9")


def test_custom_device_needs_three_numbers():
    d = get_device("custom", memory_gib=24, bandwidth_gbs=100, tflops=10)
    assert d == Device("custom", 24, 100, 10, "user")
    with pytest.raises(InvalidParameterError, match="--tflops"):
        get_device("custom", memory_gib=24, bandwidth_gbs=100)
    with pytest.raises(InvalidParameterError):
        get_device("custom", memory_gib=-1, bandwidth_gbs=100, tflops=1)


def test_override_a_table_device():
    d = get_device("H100-SXM", memory_gib=94)
    assert (d.memory_gib, d.bandwidth_gbs) == (94, 3350)


def test_local_device_round_trip(tmp_path, monkeypatch):
    monkeypatch.setenv("KVLEDGER_CONFIG_DIR", str(tmp_path))
    with pytest.raises(InvalidParameterError, match="kvledger probe"):
        get_device("local")
    dev = Device("local", 16.0, 24.5, 0.5, "measured")
    assert save_local_device(dev) == tmp_path / "local_device.json"
    assert get_device("local") == dev
