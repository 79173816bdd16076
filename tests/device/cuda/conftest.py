"""The Triton kernels' tests run on one device per process: a CUDA GPU where there is one
(those runs carry the ``gpu`` marker: ``pytest -m gpu``), else CPU tensors under Triton's
interpreter (``TRITON_INTERPRET=1``, set here before any kernel is defined)."""

from __future__ import annotations

import importlib
import os

import pytest
import torch

ON_GPU = torch.cuda.is_available()
if not ON_GPU:
    os.environ.setdefault("TRITON_INTERPRET", "1")

DEVICES = [pytest.param("cuda", marks=pytest.mark.gpu)] if ON_GPU else ["cpu"]


@pytest.fixture(params=DEVICES)
def dev(request) -> str:
    """Where the kernels' tensors live: ``cuda`` on a GPU, ``cpu`` under the interpreter."""
    return request.param


@pytest.fixture
def count_calls(monkeypatch):
    """``count_calls(module, name)``: the calls of the Triton wrapper
    ``triton_kernels.module.name`` from here on (a list of ones)."""

    def count(module: str, name: str) -> list[int]:
        target = importlib.import_module(f"kvledger.device.cuda.triton_kernels.{module}")
        calls, inner = [], getattr(target, name)

        def counted(*args, **kwargs):
            calls.append(1)
            return inner(*args, **kwargs)

        monkeypatch.setattr(target, name, counted)
        return calls

    return count
