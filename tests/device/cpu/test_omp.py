"""Freeing a thread's OpenMP pool (kvledger.device.cpu.omp) leaves torch's parallel ops correct."""

import threading

import torch

from kvledger.device.cpu.omp import release_thread_pool


def _parallel_op(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.linear(x, w).relu().sum(-1)  # large enough to run in parallel


def test_release_then_compute_in_this_thread_and_another():
    gen = torch.Generator().manual_seed(0)
    x, w = torch.randn(64, 512, generator=gen), torch.randn(1024, 512, generator=gen)
    expected = (x.double() @ w.double().T).relu().sum(-1)
    assert torch.allclose(_parallel_op(x, w).double(), expected, rtol=1e-4)
    # torch's wheels for Linux x86 run on libgomp, which has OpenMP 5.0's pause call
    assert release_thread_pool() is True
    results = {}
    worker = threading.Thread(target=lambda: results.update(other=_parallel_op(x, w)))
    worker.start()
    worker.join()
    assert torch.allclose(results["other"].double(), expected, rtol=1e-4)
    assert torch.allclose(_parallel_op(x, w).double(), expected, rtol=1e-4)  # the pool is back
    assert release_thread_pool() is True  # and can be freed again


def test_release_in_a_thread_that_never_computed():
    results = []
    worker = threading.Thread(target=lambda: results.append(release_thread_pool()))
    worker.start()
    worker.join()
    assert results == [True]
