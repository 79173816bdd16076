"""Perplexity as llama.cpp's ``llama-perplexity`` measures it, through the engine's KV cache.

Protocol (llama.cpp ``tools/perplexity``): the tokenized text is cut into non-overlapping
chunks of ``context`` tokens (a remainder shorter than a chunk is dropped); each chunk runs from
an empty cache; only the second half is scored, so every scored token sees at least
``context / 2`` tokens of context: the logits at positions ``context/2 .. context-2`` predict
tokens ``context/2 + 1 .. context-1``. PPL = exp(mean negative log-likelihood).

With a base engine (``--kl-divergence``) both engines run each chunk in lockstep and, per
scored position, the KL divergence KL(P_base || P) = sum_v P_base(v) (log P_base(v) - log P(v))
and whether both put the same token first (llama.cpp's "Mean KLD" and "Same top p"), and the
KLD's maximum, 99.9 % and 99.0 % percentiles and median over the scored positions (llama.cpp's
``percentile``: linear interpolation between the sorted values, ``tools/perplexity``).
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import asdict, dataclass

import torch

from kvledger.errors import InvalidParameterError
from kvledger.eval.scoring import step_logprobs

RETENTION_STRIDE = 32
"""Default step under an evicting retention policy (the issue's; eviction between steps)."""


@dataclass
class PerplexityResult:
    """One perplexity run.

    Attributes:
        kv_format: the evaluated engine's KV format; base_kv_format: the reference's (or None).
        context, stride: chunk length and feeding step, tokens.
        chunks, tokens_scored: chunks run and tokens scored in all.
        ppl: perplexity; nll: mean negative log-likelihood (nats per token).
        chunk_ppl: perplexity of each chunk.
        ppl_base, kld_mean, top1_agreement: the base run's PPL, mean KL divergence (nats) and
            share of positions with the same argmax (None without a base).
        kld_max, kld_p999, kld_p99, kld_median: the KLD's maximum, 99.9 % and 99.0 %
            percentiles and median over the scored positions (nats; None without a base).
        kv_policy: the engine's retention policy (``RetentionSpec.describe``).
    """

    text: str
    kv_format: str
    base_kv_format: str | None
    context: int
    stride: int
    chunks: int
    tokens_scored: int
    ppl: float
    nll: float
    chunk_ppl: list[float]
    ppl_base: float | None = None
    kld_mean: float | None = None
    top1_agreement: float | None = None
    kld_max: float | None = None
    kld_p999: float | None = None
    kld_p99: float | None = None
    kld_median: float | None = None
    kv_policy: str = "full (every token kept)"

    @property
    def delta_ppl_pct(self) -> float | None:
        """(ppl / ppl_base - 1) x 100, or None without a base."""
        return None if self.ppl_base is None else 100 * (self.ppl / self.ppl_base - 1)

    def to_json(self) -> dict:
        """The ``--json`` object: every attribute plus ``delta_ppl_pct``."""
        return {**asdict(self), "delta_ppl_pct": self.delta_ppl_pct}


def check_protocol(context: int, stride: int | None) -> None:
    """Validate ``--context`` and ``--stride`` before any work.

    Raises:
        InvalidParameterError: ``context < 4`` or ``stride`` outside ``[1, context]``.
    """
    if context < 4:
        raise InvalidParameterError(f"--context must be >= 4, got {context}")
    if stride is not None and not 1 <= stride <= context:
        raise InvalidParameterError(f"--stride must be in [1, --context], got {stride}")


def chunk_tokens(ids: list[int], context: int, max_chunks: int | None = None) -> list[list[int]]:
    """Non-overlapping chunks of ``context`` tokens (the remainder dropped), at most
    ``max_chunks`` of them.

    Raises:
        InvalidParameterError: ``context < 4`` or the text holds less than one chunk.
    """
    check_protocol(context, None)
    n = len(ids) // context
    if n == 0:
        raise InvalidParameterError(
            f"the text has {len(ids)} tokens, fewer than one chunk of --context {context}")
    if max_chunks is not None:
        n = min(n, max_chunks)
    return [ids[i * context:(i + 1) * context] for i in range(n)]


def kld_percentile(values: torch.Tensor, fraction: float) -> float:
    """llama.cpp's percentile of sorted ``values`` [n]: linear interpolation at
    ``fraction x (n - 1)`` (``tools/perplexity/perplexity.cpp``)."""
    p = fraction * (len(values) - 1)
    i = int(p)
    hi = values[min(i + 1, len(values) - 1)]
    return float((1 - (p - i)) * values[i] + (p - i) * hi)


def perplexity(engine, ids: list[int], context: int, stride: int | None = None,
               max_chunks: int | None = None, base=None, text: str = "") -> PerplexityResult:
    """Run the protocol over token ids ``ids`` on ``engine`` (and ``base``, for the KLD).

    Args:
        stride: tokens fed per step (None = the engine's prefill chunk, ``--max-num-batched-
            tokens``, as generation prefills a prompt; under an evicting ``--kv-policy``,
            ``RETENTION_STRIDE`` tokens with eviction between steps).

    Raises:
        InvalidParameterError: bad context or stride, text shorter than one chunk.
    """
    *_, last = perplexity_runs([engine], ids, context, stride, max_chunks, base, text)
    return last[0]


@dataclass
class _Tally:
    """One engine's running sums over the chunks done so far."""

    nll: float = 0.0
    count: int = 0
    base_nll: float = 0.0
    same_top: int = 0

    def __post_init__(self) -> None:
        self.chunk_ppl: list[float] = []
        self.klds: list[torch.Tensor] = []


def perplexity_runs(engines: list, ids: list[int], context: int, stride: int | None = None,
                    max_chunks: int | None = None, base=None, text: str = ""
                    ) -> Iterator[list[PerplexityResult]]:
    """The protocol on several engines against one ``base`` run per chunk (the base is fed
    once per chunk, not once per engine): after each chunk, yields one result per engine of
    ``engines`` over the chunks done so far (the last yield is the whole run).

    Every engine and the base are fed ``stride`` tokens per step (default: the first engine's
    prefill chunk, its ``max_num_batched_tokens`` (the chunk ``generate`` and ``serve``
    prefill a prompt in), at most the whole chunk; ``RETENTION_STRIDE`` when an engine's
    ``--kv-policy`` evicts). The base's log-probabilities
    of a chunk are kept ([context / 2, vocab] fp32) while the engines run it.

    Raises:
        InvalidParameterError: bad context or stride, text shorter than one chunk.
    """
    check_protocol(context, stride)
    evicts = any(e.config.retention.evicts for e in engines)
    stride = stride or (RETENTION_STRIDE if evicts
                        else min(context, engines[0].config.max_num_batched_tokens))
    first = context // 2
    tallies = [_Tally() for _ in engines]
    for chunk in chunk_tokens(ids, context, max_chunks):
        target = torch.tensor(chunk)
        base_lp = None if base is None else torch.cat(
            [lp for _, lp in step_logprobs(base, chunk, stride, first)])
        for engine, t in zip(engines, tallies):
            chunk_nll, chunk_count = 0.0, 0
            for pos, lp in step_logprobs(engine, chunk, stride, first):
                rows = lp.shape[0]
                nxt = target[pos + 1: pos + 1 + rows]
                chunk_nll -= float(lp.gather(1, nxt[:, None]).sum())
                chunk_count += rows
                if base_lp is not None:
                    blp = base_lp[pos - first: pos - first + rows]
                    t.base_nll -= float(blp.gather(1, nxt[:, None]).sum())
                    t.klds.append((blp.exp() * (blp - lp)).sum(-1).double())
                    t.same_top += int((blp.argmax(-1) == lp.argmax(-1)).sum())
            t.nll, t.count = t.nll + chunk_nll, t.count + chunk_count
            t.chunk_ppl.append(math.exp(chunk_nll / chunk_count))
        yield [_result(e, t, base, context, stride, text) for e, t in zip(engines, tallies)]


def _result(engine, t: _Tally, base, context: int, stride: int, text: str) -> PerplexityResult:
    """``t``'s sums as a result (KLD statistics over every scored position so far)."""
    result = PerplexityResult(
        text=text, kv_format=engine.kv_format,
        base_kv_format=None if base is None else base.kv_format, context=context,
        stride=stride, chunks=len(t.chunk_ppl), tokens_scored=t.count,
        ppl=math.exp(t.nll / t.count), nll=t.nll / t.count, chunk_ppl=list(t.chunk_ppl),
        kv_policy=engine.config.retention.describe())
    if base is not None:
        kld = torch.cat(t.klds).sort().values
        result.kld_mean, result.top1_agreement = float(kld.sum()) / t.count, t.same_top / t.count
        result.kld_max, result.kld_median = float(kld[-1]), kld_percentile(kld, 0.5)
        result.kld_p999, result.kld_p99 = kld_percentile(kld, 0.999), kld_percentile(kld, 0.99)
        result.ppl_base = math.exp(t.base_nll / t.count)
    return result
