"""A tensor-parallel worker (rank >= 1): ``python -m kvledger.engine.parallel.worker``.

Started by rank 0 (:mod:`.launch`) with ``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR`` and
``MASTER_PORT`` in its environment, or reached from a torchrun rank through
:func:`serve`. It takes its setup from rank 0, loads the model and keeps its share, builds its
KV store (its KV heads in the pool's block count, the ledger's per-rank bytes; a quantized
format keeps the calibrated outlier channels of those heads), then runs every step rank 0
broadcasts until rank 0 sends None (shutdown) or its connection goes away (the process exits).
"""

from __future__ import annotations

import ctypes
import logging
import os
import signal
import sys
from datetime import timedelta

import torch.distributed as dist

from kvledger.engine.config import EngineConfig
from kvledger.engine.parallel.group import (
    RENDEZVOUS_TIMEOUT_S,
    RankGroup,
    TensorParallelError,
    ready_key,
)
from kvledger.engine.parallel.rank_model import build_rank_model
from kvledger.engine.parallel.runner import run_step

PR_SET_PDEATHSIG = 1
log = logging.getLogger("kvledger.engine")


def serve(group: RankGroup) -> None:
    """Run this rank until rank 0 stops it.

    Raises:
        TensorParallelError: rank 0 went away or a collective failed.
    """
    from kvledger.device import resolve
    from kvledger.engine.kv.calibration import outlier_index
    from kvledger.engine.kv.layout import resolve_layout
    from kvledger.engine.tuning.tuned import TunedDevice
    from kvledger.model.weights.loader import load_weights

    setup = group.broadcast()
    config = EngineConfig(**setup["config"])
    device = resolve(config.device)  # the device rank 0 resolved, by its name
    device.threads(setup["threads"])
    dtype = setup["dtype"]
    try:
        spec, weights = load_weights(config.model, dtype, config.load_format)
        model = build_rank_model(spec, weights, dtype, group, setup["attention"],
                                 setup["formats"], TunedDevice(device))
        del weights
        store = None
        if config.use_kv_cache:
            layout = resolve_layout(config, spec, dtype)
            store = layout.build_store(setup["num_blocks"], outlier_index(config, spec, layout),
                                       group.rank, device.kernels)
    except Exception as exc:  # noqa: BLE001 - reported to rank 0 as one line, then exit
        group.gather_objects(f"tensor-parallel rank {group.rank} could not load the model: "
                             f"{exc}")
        raise SystemExit(1) from None
    group.gather_objects(store.nbytes if store is not None else 0)
    while (step := group.broadcast()) is not None:
        run_step(model, store, step, group)
    group.destroy()


def _die_with_parent() -> None:
    """Exit when the process that started this one exits (Linux ``PR_SET_PDEATHSIG``)."""
    parent = int(os.environ.get("KVLEDGER_TP_PARENT", "0"))
    try:
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    except (OSError, AttributeError):
        pass  # not Linux: the closed connection still ends the worker
    if parent and os.getppid() != parent:
        raise SystemExit(1)  # the parent is already gone


def main() -> None:
    """Join the group from the environment and serve."""
    _die_with_parent()
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    timeout_s = float(os.environ.get("KVLEDGER_TP_TIMEOUT_S", "60"))
    timeout = timedelta(seconds=max(timeout_s, RENDEZVOUS_TIMEOUT_S))
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world,
                          is_master=False, timeout=timeout)
    store.set(ready_key(rank), "1")
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world, timeout=timeout)
    try:
        serve(RankGroup(rank, world, timeout_s))
    except TensorParallelError as exc:
        print(f"kvledger tensor-parallel rank {rank}: {exc}", file=sys.stderr)
        raise SystemExit(1) from None


if __name__ == "__main__":
    main()
