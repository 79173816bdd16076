"""RankGroup: this process's place among the tensor-parallel ranks, and the collectives they run.

Two gloo groups over the same ranks, beside the default group that only served the rendezvous
(``torch.distributed``; NCCL would take the data group on CUDA, which the engine has no path
for yet):

- the *data* group (timeout ``tp_timeout_s``): the all-reduce after the
  attention output and the MLP of every layer, and the gather of the vocabulary-split logits
  on rank 0. A rank that died or hangs makes it fail within the timeout;
- the *control* group (a timeout of :data:`CONTROL_TIMEOUT`): rank 0's broadcast of each
  step's inputs, for which the other ranks may wait as long as the server stays idle, and the
  start-up exchange (model loading can take minutes).

The first failed collective turns into :class:`TensorParallelError` (HTTP 503); the group is
then *failed* for good (``failure`` says why) and every later collective raises at once.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from datetime import timedelta

import torch
import torch.distributed as dist

from kvledger.errors import KVLedgerError

CONTROL_TIMEOUT = timedelta(days=30)
RENDEZVOUS_TIMEOUT_S = 1800.0  # most seconds for every rank to start (torch import, niced)
log = logging.getLogger("kvledger.engine")


class TensorParallelError(KVLedgerError):
    """A tensor-parallel rank died, hung past the collective timeout, or cannot start: the
    engine cannot compute (HTTP 503; ``/health`` reports it)."""

    http_status = 503
    code = "engine_unavailable"


class RankGroup:
    """Collectives of one rank; the default process group must be initialised (gloo).

    Args:
        rank, world: this rank and the number of ranks.
        timeout_s: the data group's collective timeout.

    Attributes:
        explain: called with a failed collective's exception, returns the sentence
            ``failure`` keeps (rank 0's launcher names the worker that exited).
        comm_s: seconds spent in all-reduce and gather on the data group so far.
    """

    def __init__(self, rank: int, world: int, timeout_s: float) -> None:
        self.rank, self.world = rank, world
        self.data = dist.new_group(backend="gloo", timeout=timedelta(seconds=timeout_s))
        self.control = dist.new_group(backend="gloo", timeout=CONTROL_TIMEOUT)
        self.failure: str | None = None
        self.comm_s = 0.0
        self.explain: Callable[[Exception], str] = describe_failure

    def all_reduce(self, tensor: torch.Tensor) -> None:
        """Sum ``tensor`` over the ranks, in place (data group)."""
        self._run(dist.all_reduce, tensor, group=self.data)

    def gather(self, tensor: torch.Tensor) -> list[torch.Tensor] | None:
        """Every rank's ``tensor`` (same shape and dtype on all) in rank order, on rank 0;
        None on the other ranks (data group)."""
        parts = [torch.empty_like(tensor) for _ in range(self.world)] if self.rank == 0 else None
        self._run(dist.gather, tensor, parts, dst=0, group=self.data)
        return parts

    def broadcast(self, obj=None):
        """Rank 0's ``obj`` (any picklable object, tensors included) on every rank (control
        group)."""
        box = [obj]
        self._run(dist.broadcast_object_list, box, src=0, group=self.control, timed=False)
        return box[0]

    def gather_objects(self, obj) -> list | None:
        """Every rank's ``obj`` in rank order on rank 0, None elsewhere (control group)."""
        out = [None] * self.world if self.rank == 0 else None
        self._run(dist.gather_object, obj, out, dst=0, group=self.control, timed=False)
        return out

    def _run(self, collective, *args, timed: bool = True, **kwargs) -> None:
        if self.failure is not None:
            raise TensorParallelError(self.failure)
        start = time.perf_counter()
        try:
            collective(*args, **kwargs)
        except Exception as exc:
            self.failure = self.explain(exc)
            log.error("tensor parallel, rank %d: %s", self.rank, self.failure)
            raise TensorParallelError(self.failure) from exc
        if timed:
            self.comm_s += time.perf_counter() - start

    def destroy(self) -> None:
        """Leave the process group (best effort: peers may be gone already)."""
        try:
            dist.destroy_process_group()
        except Exception as exc:  # noqa: BLE001 - shutting down anyway
            log.debug("destroy_process_group: %s", exc)


def ready_key(rank: int) -> str:
    """The rendezvous store key a worker sets once it runs (before it joins the group)."""
    return f"kvledger-tp-ready-{rank}"


def describe_failure(exc: Exception) -> str:
    """One line on a failed collective: its error's first line."""
    text = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
    return f"a tensor-parallel collective failed ({text}); the engine cannot compute"
