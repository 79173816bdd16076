"""Retention policies (``--kv-policy``) in replay: the engine's retention state without a model.

A replayed request gets the retention ``LLMEngine.add_request`` gives it
(``kvledger.engine.retention.build.retention_for``): under an evicting policy a
:class:`~kvledger.engine.retention.state.RetainedKV` over the policy object of
``kvledger.engine.retention.policies``. ``Scheduler.advance`` then runs the engine's own
``evict`` and ``reclaim`` on it after every step, so blocks go back to the pool as the sequence
advances, and token-level policies compact their holes, exactly as they do live. Compaction
gets :class:`NoKVStore`, a store of no layers: the block moves happen, no K/V is copied.

What the replay predicts, per policy:

- ``window`` / ``sinks``: the kept tokens follow from positions alone; the replay holds the
  same tokens, blocks and pool as the engine (exact).
- ``h2o`` / ``snapkv``: the *number* of kept tokens after each step is fixed by the budget, but
  *which* ones the engine keeps depends on attention scores the replay does not have. Their
  policy object is wrapped in :class:`ReplayedPolicy`, which keeps the policy's count with a
  score-free stand-in selection: position as the score (the most recent tokens win the top-k).
  Only the block and KV accounting is predicted, never which tokens are kept, and even that can
  differ from the engine's by one block per sequence at a step: after ``reclaim`` a sequence
  holds ``ceil(slots / block_size)`` blocks with ``held <= slots < held + block_size`` (holes
  below one block's worth are not compacted, and whether a block empties entirely depends on
  which tokens were dropped).
- h2o / snapkv selecting per head (``RetentionSpec.select``, the default): the engine keeps
  every row's tokens in whole blocks with no holes, so the blocks held follow from the count
  alone; the replay holds one row (``PerHeadKV`` of 1 x 1) and predicts the engine's blocks
  exactly, except for the copy-on-write of a shared block, which depends on where the rows'
  holes fall.
- Exact for h2o/snapkv too when the trace recorded the engine's choices: ``kvledger serve
  --trace`` writes, per step, the positions each evicting request dropped (``evicted``, see
  :mod:`kvledger.replay.trace`). While the replay runs the recorded schedule under the
  recorded policy (step ``i`` computes the chunks the trace's step ``i`` computed), the wrapper
  drops exactly those positions (:attr:`ReplayedPolicy.recorded`); once the schedules part, the
  stand-in takes over.
"""

from __future__ import annotations

import torch

from kvledger.engine.retention.build import retention_for
from kvledger.engine.retention.interface import Retention
from kvledger.engine.retention.policies import RetentionPolicy, make_policy
from kvledger.ledger.retention import RetentionSpec


class NoKVStore:
    """A KV store of no layers: compaction moves blocks in the pool and copies nothing."""

    key_blocks: tuple = ()

    def copy_slots(self, src, dst) -> None:
        """Compaction's K/V copy (:meth:`kvledger.engine.kv.store.KVStore.copy_slots`): none."""

    def copy_head_slots(self, rows, src, dst) -> None:
        """Per-head compaction's copy (``KVStore.copy_head_slots``): none."""


class ReplayedPolicy:
    """A token-level policy (one that ``compacts``) with a score-free stand-in selection.

    Every attribute but :meth:`keep` is the wrapped policy's (``spec``, ``chunked``,
    ``compacts``, ``visible``, ``scored_queries``).

    Attributes:
        inner: the engine's policy object.
        recorded: positions the engine dropped at the step being replayed (a set of ints), set
            by the simulator for one step; None: no recording applies, use the stand-in.
    """

    def __init__(self, inner: RetentionPolicy) -> None:
        self.inner = inner
        self.recorded: set[int] | None = None

    def __getattr__(self, name: str):
        return getattr(self.inner, name)

    def keep(self, pos: torch.Tensor, scores: torch.Tensor, next_pos: int,
             num_prompt_tokens: int, compressed: bool) -> torch.Tensor:
        """[h] bool: the recorded choice, else the policy's own rule with ``pos`` [h] as the
        scores (its count of kept tokens, the most recent of the candidates)."""
        if self.recorded is not None:
            dropped = torch.tensor(sorted(self.recorded), dtype=pos.dtype)
            return ~torch.isin(pos, dropped)
        return self.inner.keep(pos, pos.float(), next_pos, num_prompt_tokens, compressed)


def retained_kv(spec: RetentionSpec, block_size: int) -> Retention:
    """The retention a replayed request of policy ``spec`` starts with: the engine's, one
    (layer, KV head) row, a token-level policy wrapped in :class:`ReplayedPolicy`."""
    policy = make_policy(spec)
    policy = ReplayedPolicy(policy) if policy.compacts else policy
    return retention_for(spec, block_size, policy=policy)


def dropped_ranges(positions: list[int]) -> list[list[int]]:
    """Sorted positions -> half-open ``[lo, hi)`` runs (how a trace writes them)."""
    runs: list[list[int]] = []
    for p in positions:
        if runs and runs[-1][1] == p:
            runs[-1][1] = p + 1
        else:
            runs.append([p, p + 1])
    return runs


def positions_of(ranges: list[list[int]]) -> set[int]:
    """``[[lo, hi), ...]`` -> the set of positions."""
    return {p for lo, hi in ranges for p in range(lo, hi)}
