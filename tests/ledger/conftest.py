"""Fixtures for the ledger tests: the real config.json files bundled in ``kvledger.data``."""

from __future__ import annotations

import pytest

from kvledger.data import config_path
from kvledger.model.families import spec_from_hf_config


@pytest.fixture
def real_spec():
    """``real_spec("meta-llama__Llama-3.1-8B")`` -> ModelSpec of that vendored config."""

    def load(name: str):
        return spec_from_hf_config(config_path(name))

    return load
