"""Retention policies: which held tokens a sequence keeps, and which keys a query may see.

One base class (:class:`RetentionPolicy`, which is full retention), one class per policy of
``ledger/retention.py``. A policy is stateless; the per-sequence state (positions held,
accumulated scores) is :class:`kvledger.engine.retention.state.RetainedKV`, a request's
``Retention`` (``interface.py``). Two decisions per policy:

- ``visible(q_pos, k_pos)``: beyond causality, may a query at position q see the held key at
  position k? This makes a policy token-exact inside a chunk of several new tokens (window and
  sinks: each query has its own window; the mask-only reference of the tests uses the same
  function with every key held).
- ``keep(pos, scores, next_pos, ...)``: after a step, which held tokens stay for the queries
  from ``next_pos`` on. Dropped tokens are never attended again; their blocks go back to the
  pool once none of their tokens is kept.

Positions: kept keys keep their original positions (RoPE applied once, when the key was
computed; kvpress's default), or under window/sinks with ``positions="cache"`` attend as if
they sat at 0..n-1 in the cache (StreamingLLM; ``state.py: RetainedKV.key_shift``).

``keep`` takes one row of held tokens ([h]) or a batch of rows ([rows, h]) and decides each
row alone: per-sequence selection passes one row (scores summed over layers and heads),
per-head selection one row per (layer, KV head) with that head's scores
(``RetentionSpec.select``, ``per_head.py``). Every row keeps the same number of tokens, since
sinks, recent window and observation window are positions every row holds.

Scope ``prompt`` (``RetentionSpec.scope``; :class:`PromptWindowPolicy`,
:class:`PromptH2OPolicy`): the prompt is prefilled with full attention, its tokens are chosen
once when it is all in (as snapkv does), and every later token is kept and seen.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kvledger.ledger.retention import RetentionSpec


class RetentionPolicy:
    """Keep everything (``full``); the base of every policy.

    Attributes:
        spec: the policy's sizes.
        compacts: True for token-level policies, whose holes are compacted into fewer blocks.
        chunked: True when a sequence is computed in chunks of at most ``EVICTION_CHUNK``
            tokens so that eviction between steps bounds its KV.
    """

    compacts = False
    chunked = False

    def __init__(self, spec: RetentionSpec) -> None:
        self.spec = spec

    def visible(self, q_pos: torch.Tensor, k_pos: torch.Tensor) -> torch.Tensor:
        """[n, c] bool: query positions q_pos [n] may see keys at k_pos [c] (causality apart)."""
        return torch.ones(len(q_pos), len(k_pos), dtype=torch.bool)

    def keep(self, pos: torch.Tensor, scores: torch.Tensor, next_pos: int,
             num_prompt_tokens: int, compressed: bool) -> torch.Tensor:
        """[..., h] bool: which of the held tokens at positions ``pos`` [..., h] (with
        accumulated attention ``scores`` [..., h]) stay for queries from ``next_pos`` on;
        each row of a batch decided alone."""
        return torch.ones_like(pos, dtype=torch.bool)

    def scored_queries(self, q_pos: torch.Tensor, num_prompt_tokens: int) -> torch.Tensor | None:
        """[n] bool: which queries' attention is accumulated into the scores (None = none)."""
        return None


class WindowPolicy(RetentionPolicy):
    """``window``/``sinks``: the first S tokens and the W most recent (the query included)."""

    chunked = True

    def visible(self, q_pos, k_pos):
        s, w = self.spec.sinks, self.spec.window
        return (k_pos[None, :] < s) | (k_pos[None, :] > q_pos[:, None] - w)

    def keep(self, pos, scores, next_pos, num_prompt_tokens, compressed):
        return (pos < self.spec.sinks) | (pos > next_pos - self.spec.window)


def _top(scores: torch.Tensor, candidates: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """[..., h] bool: in each row, the ``k`` [...] candidates with the highest score."""
    k = torch.minimum(k, candidates.sum(-1))
    chosen = torch.zeros_like(candidates)
    most = int(k.max()) if k.numel() else 0
    if most > 0:
        masked = scores.float().masked_fill(~candidates, -torch.inf)
        best = masked.topk(most, -1).indices  # [..., most], highest first
        chosen.scatter_(-1, best, torch.arange(most) < k[..., None])
    return chosen


def h2o_ranking(spec: RetentionSpec, scores: torch.Tensor, pos: torch.Tensor,
                queries_end: int) -> torch.Tensor:
    """[..., h] what h2o ranks held keys by: their accumulated attention ``scores`` (``sum``),
    or under ``h2o_scores="mean"`` that divided by the scored queries that saw each key, the
    positions ``pos .. queries_end - 1`` (a held key was seen by every later scored query;
    kvpress's ObservedAttentionPress divides by the same count)."""
    if spec.h2o_scores != "mean":
        return scores
    return scores.float() / (queries_end - pos).clamp(min=1)


class H2OPolicy(RetentionPolicy):
    """``h2o``: at most B - 1 held between steps: S sinks, the W - 1 most recent and the
    B - S - W held tokens with the highest accumulated attention (heavy hitters)."""

    compacts = True
    chunked = True

    def keep(self, pos, scores, next_pos, num_prompt_tokens, compressed):
        spec = self.spec
        if pos.shape[-1] <= spec.budget - 1:
            return torch.ones_like(pos, dtype=torch.bool)
        protected = (pos < spec.sinks) | (pos > next_pos - spec.window)
        heavy = spec.budget - 1 - protected.sum(-1)
        return protected | _top(h2o_ranking(spec, scores, pos, next_pos), ~protected, heavy)

    def scored_queries(self, q_pos, num_prompt_tokens):
        return torch.ones(len(q_pos), dtype=torch.bool)


class SnapKVPolicy(RetentionPolicy):
    """``snapkv``: when the prompt is prefilled, keep B of its tokens (the last w and the top
    B - w by pooled attention of those w queries); afterwards keep everything."""

    compacts = True

    def keep(self, pos, scores, next_pos, num_prompt_tokens, compressed):
        spec = self.spec
        held = torch.ones_like(pos, dtype=torch.bool)
        if compressed or next_pos < num_prompt_tokens or pos.shape[-1] <= spec.budget:
            return held
        window = pos >= num_prompt_tokens - spec.snapkv_window
        pooled = pool_scores(scores, spec.snapkv_kernel)
        return window | _top(pooled, ~window, spec.budget - window.sum(-1))

    def scored_queries(self, q_pos, num_prompt_tokens):
        lo = num_prompt_tokens - self.spec.snapkv_window
        return (q_pos >= lo) & (q_pos < num_prompt_tokens)


def pool_scores(scores: torch.Tensor, kernel: int) -> torch.Tensor:
    """Average of each score with its ``kernel // 2`` neighbours on each side along the last
    dimension ([..., h] -> [..., h]; SnapKV's 1-D pooling, padding counted as zeros)."""
    if kernel <= 1 or scores.shape[-1] == 0:
        return scores
    rows = scores.reshape(-1, 1, scores.shape[-1]).float()
    pooled = F.avg_pool1d(rows, kernel, stride=1, padding=kernel // 2)
    return pooled.view(scores.shape)


class PromptWindowPolicy(RetentionPolicy):
    """``window``/``sinks`` in scope ``prompt``: when the prompt (P tokens) is prefilled, keep
    its first S and last W tokens (kvpress's StreamingLLMPress keeps ``n_sink`` + the most
    recent); every later token is kept. Every query sees every held key."""

    def keep(self, pos, scores, next_pos, num_prompt_tokens, compressed):
        if next_pos < num_prompt_tokens:
            return torch.ones_like(pos, dtype=torch.bool)
        return (pos < self.spec.sinks) | (pos >= num_prompt_tokens - self.spec.window)


class PromptH2OPolicy(RetentionPolicy):
    """``h2o`` in scope ``prompt``: when the prompt is prefilled, keep B of its tokens: S
    sinks, its last W and the B - S - W others with the highest attention summed over every
    prompt query (kvpress's ObservedAttentionPress scores by prefill attention too; see
    BENCHMARKS.md for how its scores differ); every later token is kept, and not scored."""

    compacts = True

    def keep(self, pos, scores, next_pos, num_prompt_tokens, compressed):
        spec = self.spec
        if compressed or next_pos < num_prompt_tokens or pos.shape[-1] <= spec.budget:
            return torch.ones_like(pos, dtype=torch.bool)
        protected = (pos < spec.sinks) | (pos >= num_prompt_tokens - spec.window)
        ranking = h2o_ranking(spec, scores, pos, num_prompt_tokens)
        return protected | _top(ranking, ~protected, spec.budget - protected.sum(-1))

    def scored_queries(self, q_pos, num_prompt_tokens):
        return q_pos < num_prompt_tokens


POLICY_CLASSES = {"full": RetentionPolicy, "window": WindowPolicy, "sinks": WindowPolicy,
                  "h2o": H2OPolicy, "snapkv": SnapKVPolicy}


def make_policy(spec: RetentionSpec) -> RetentionPolicy:
    """The policy object of ``spec`` (scope ``prompt``: its prompt-only class)."""
    if spec.scope == "prompt":
        return (PromptH2OPolicy if spec.policy == "h2o" else PromptWindowPolicy)(spec)
    return POLICY_CLASSES[spec.policy](spec)
