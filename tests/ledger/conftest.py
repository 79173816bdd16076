"""Fixtures for the ledger tests: the vendored real config.json files (``../shared``)."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvledger.spec_hf import spec_from_hf_config

CONFIGS = Path(__file__).resolve().parents[2].parent / "shared" / "models" / "configs"


@pytest.fixture
def real_spec():
    """``real_spec("meta-llama__Llama-3.1-8B")`` -> ModelSpec of that vendored config."""

    def load(name: str):
        return spec_from_hf_config(CONFIGS / f"{name}.json")

    return load
