"""Starting the ranks: rank 0 is the engine's own process; the others are started here or by
``torchrun``.

- **One machine, one command** (``kvledger serve --tensor-parallel-size N``): rank 0 starts
  ``N - 1`` worker processes (``python -m kvledger.engine.parallel.worker``) and they meet at a
  free loopback port (``tcp://`` rendezvous). Each worker dies with its parent
  (``PR_SET_PDEATHSIG``) and exits when rank 0's connection closes; :meth:`TensorParallel.close`
  (also at interpreter exit) stops them and kills any left after a grace period.
- **torchrun** (one or several machines): every process runs the same kvledger command with
  ``RANK`` / ``WORLD_SIZE`` / ``MASTER_ADDR`` / ``MASTER_PORT`` set (``env://``); rank 0 goes
  on as the engine, every other rank turns into a worker inside :func:`TensorParallel.start`
  and exits the process when rank 0 shuts down.

After the rendezvous rank 0 broadcasts the setup (the EngineConfig, the attention backend and
weight formats it chose, the pool's block count); each worker loads the model, keeps its share
(:mod:`.rank_model`), builds its KV store and reports the store's bytes back.
"""

from __future__ import annotations

import atexit
import dataclasses
import logging
import os
import socket
import subprocess
import sys
import time
from datetime import timedelta
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from kvledger.engine.config import EngineConfig
from kvledger.engine.parallel.group import (
    RENDEZVOUS_TIMEOUT_S,
    RankGroup,
    TensorParallelError,
    describe_failure,
    ready_key,
)
from kvledger.engine.parallel.rank_model import build_rank_model
from kvledger.engine.parallel.runner import ParallelRunner
from kvledger.engine.parallel.shard import check_divisible
from kvledger.errors import InvalidParameterError
from kvledger.spec import ModelSpec

if TYPE_CHECKING:
    from kvledger.device import Device
    from kvledger.engine.tuning.tuned import TunedDevice

WORKER_MODULE = "kvledger.engine.parallel.worker"
EXIT_GRACE_S = 10.0
log = logging.getLogger("kvledger.engine")


class TensorParallel:
    """Rank 0's handle on the group: the rank model, the setup of the workers, shutdown.

    Attributes:
        group: the collectives; kv_pool_bytes: each rank's KV store bytes (after ``runner``).
    """

    def __init__(self, group: RankGroup, workers: list[subprocess.Popen]) -> None:
        self.group, self.workers = group, workers
        self.kv_pool_bytes: list[int] = []
        if workers:
            group.explain = self.explain
        self._closed = False
        atexit.register(self.close)

    @classmethod
    def start(cls, config: EngineConfig, spec: ModelSpec, device: Device) -> TensorParallel:
        """Check that ``spec`` splits, then start (or join, under torchrun) the ranks on
        ``device`` (the workers resolve it from ``config.device``). In a torchrun rank other
        than 0 this serves as a worker and exits the process.

        Raises:
            InvalidParameterError: the size does not divide the heads or the MLP, torchrun's
                WORLD_SIZE differs from it, or a tensor-parallel engine already runs here.
            TensorParallelError: a worker exited while starting, or they did not all start
                within RENDEZVOUS_TIMEOUT_S.
        """
        tp = config.tensor_parallel_size
        check_divisible(spec, tp)
        if dist.is_initialized():
            raise InvalidParameterError(
                "one tensor-parallel engine per process: close() the other one first")
        cores = device.compute_units()
        if tp > cores:
            log.warning("--tensor-parallel-size %d is more than the %d CPUs usable here: the "
                        "ranks share cores, so every step is slower than with fewer ranks",
                        tp, cores)
        timeout = timedelta(seconds=max(config.tp_timeout_s, RENDEZVOUS_TIMEOUT_S))
        if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
            return cls._join_torchrun(tp, timeout, config.tp_timeout_s)
        port = _free_port()
        store = dist.TCPStore("127.0.0.1", port, tp, is_master=True, timeout=timeout,
                              wait_for_workers=False)
        env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
               "WORLD_SIZE": str(tp), "KVLEDGER_TP_TIMEOUT_S": str(config.tp_timeout_s),
               "KVLEDGER_TP_PARENT": str(os.getpid())}
        workers = [subprocess.Popen([sys.executable, "-m", WORKER_MODULE],
                                    env={**env, "RANK": str(r)}) for r in range(1, tp)]
        try:
            _wait_ready(store, workers, timeout.total_seconds())
            dist.init_process_group("gloo", store=store, rank=0, world_size=tp, timeout=timeout)
        except Exception as exc:  # noqa: BLE001 - a worker failed to start
            exited = _exits(workers)
            _stop(workers, 0.0)
            raise TensorParallelError(f"the tensor-parallel workers did not start: "
                                      f"{exited or describe_failure(exc)}") from None
        log.info("tensor parallel: %d ranks over gloo (worker pids %s)", tp,
                 ", ".join(str(w.pid) for w in workers))
        return cls(RankGroup(0, tp, config.tp_timeout_s), workers)

    @classmethod
    def _join_torchrun(cls, tp: int, timeout: timedelta, timeout_s: float) -> TensorParallel:
        rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        if world != tp:
            raise InvalidParameterError(f"torchrun started {world} ranks but "
                                        f"--tensor-parallel-size is {tp}")
        dist.init_process_group("gloo", init_method="env://", rank=rank, world_size=world,
                                timeout=timeout)
        group = RankGroup(rank, world, timeout_s)
        if rank != 0:
            from kvledger.engine.parallel.worker import serve

            serve(group)
            raise SystemExit(0)
        return cls(group, [])

    def build_model(self, spec: ModelSpec, weights: dict, dtype: torch.dtype,
                    attention: str | None, device: TunedDevice):
        """Rank 0's share of the model on ``device`` (see :func:`build_rank_model`)."""
        return build_rank_model(spec, weights, dtype, self.group, attention, device=device)

    def runner(self, model, store, config: EngineConfig, num_blocks: int) -> ParallelRunner:
        """Hand the workers their setup, wait for their stores, return rank 0's runner.

        Raises:
            TensorParallelError: a worker failed while loading.
        """
        setup = {"config": dataclasses.asdict(config), "dtype": model.dtype,
                 "attention": model.attention.name,
                 "formats": model.formats, "num_blocks": num_blocks,
                 "threads": torch.get_num_threads()}  # LLMEngine set rank 0's share
        self.group.broadcast(setup)
        sizes = self.group.gather_objects(store.nbytes if store is not None else 0)
        if any(isinstance(s, str) for s in sizes):  # a worker's one-line error
            raise TensorParallelError(next(s for s in sizes if isinstance(s, str)))
        self.kv_pool_bytes = sizes
        return ParallelRunner(model, store, config.block_size, self.group)

    @property
    def failure(self) -> str | None:
        """Why the group cannot compute (None while it can)."""
        return self.group.failure

    def explain(self, exc: Exception) -> str:
        """The failure's sentence: the worker that exited, else the collective's error. The
        other workers are stopped (the group cannot go on without one)."""
        time.sleep(0.2)  # a killed worker's exit status shows up a moment after its socket
        exited = _exits(self.workers)
        _stop(self.workers, 0.0)
        if exited:
            return f"tensor-parallel {exited}; the engine cannot compute"
        return describe_failure(exc)

    def close(self) -> None:
        """Stop the workers (a stop message, then a kill after a grace period) and leave the
        group. Idempotent."""
        if self._closed:
            return
        self._closed = True
        atexit.unregister(self.close)
        if self.group.failure is None:
            try:
                self.group.broadcast(None)
            except TensorParallelError:
                pass
        _stop(self.workers, EXIT_GRACE_S)
        self.group.destroy()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_ready(store, workers: list[subprocess.Popen], timeout_s: float) -> None:
    """Wait until every worker has set its ready key, polling their exit: a worker that dies
    while starting fails at once, a slow one (torch import on a busy machine) is waited for up
    to ``timeout_s``.

    Raises:
        RuntimeError: a worker exited, or the time ran out.
    """
    deadline = time.monotonic() + timeout_s
    pending = list(range(1, len(workers) + 1))
    while pending:
        pending = [r for r in pending if not store.check([ready_key(r)])]
        if any(w.poll() is not None for w in workers):
            raise RuntimeError("a worker exited while starting")
        if time.monotonic() > deadline:
            raise RuntimeError(f"workers {pending} did not start within {timeout_s:.0f} s")
        time.sleep(0.2)


def _exits(workers: list[subprocess.Popen]) -> str:
    """'worker rank 2 (pid 123) exited (signal 9)' for the workers that have exited."""
    said = []
    for rank, w in enumerate(workers, start=1):
        code = w.poll()
        if code is not None:
            how = f"signal {-code}" if code < 0 else f"code {code}"
            said.append(f"worker rank {rank} (pid {w.pid}) exited ({how})")
    return ", ".join(said)


def _stop(workers: list[subprocess.Popen], grace_s: float) -> None:
    """Wait up to ``grace_s`` for the workers to exit, then kill and reap the rest."""
    deadline = time.monotonic() + grace_s
    for w in workers:
        try:
            w.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            w.kill()
            w.wait()
