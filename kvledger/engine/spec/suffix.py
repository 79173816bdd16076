"""Suffix proposals over recent requests' outputs, SuffixDecoding-style (Oliaro et al. 2024,
arXiv:2411.04975; vLLM's ``suffix`` method).

The index counts, for every context of ``n_min`` to ``n_max`` tokens seen in the outputs of the
last ``max_requests`` finished requests, the tokens that followed it. A proposal walks it from
the sequence's end: the longest context found gives its most frequent next token, which is
appended and the walk goes on, up to ``k`` tokens, while the next token is the one most often
seen there in at least ``min_share`` of the cases. Within the request itself the prompt-lookup
proposal (:mod:`.ngram`) stands in for SuffixDecoding's per-request tree; the longer match of
the two wins.

Memory is bounded by the requests kept: a request's counts are taken out when it leaves
(first in, first out), so the index never holds more than ``max_requests`` outputs'
contexts (about ``(n_max - n_min + 1)`` entries per output token).
"""

from __future__ import annotations

from collections import Counter, deque

MIN_SHARE = 0.3
"""Least share of a context's continuations the proposed token must have to go on."""


class SuffixIndex:
    """Continuation counts of recent outputs' contexts (see the module docstring)."""

    def __init__(self, n_min: int, n_max: int, max_requests: int,
                 min_share: float = MIN_SHARE) -> None:
        self.n_min, self.n_max, self.min_share = n_min, n_max, min_share
        self.max_requests = max_requests
        self._next: dict[tuple[int, ...], Counter] = {}
        self._kept: deque[tuple[int, ...]] = deque()

    def __len__(self) -> int:
        """Contexts held."""
        return len(self._next)

    def add(self, context: list[int], output: list[int]) -> None:
        """Count the contexts of ``output`` (after the last ``n_max`` tokens of ``context``,
        its prompt); the oldest request's counts leave past ``max_requests``."""
        seq = tuple(context[-self.n_max:]) + tuple(output)
        start = len(seq) - len(output)
        self._count(seq, start, +1)
        self._kept.append((seq, start))
        while len(self._kept) > self.max_requests:
            self._count(*self._kept.popleft(), -1)

    def _count(self, seq: tuple[int, ...], start: int, sign: int) -> None:
        for i in range(max(start, self.n_min), len(seq)):
            for n in range(self.n_min, min(self.n_max, i) + 1):
                key = seq[i - n: i]
                counts = self._next.setdefault(key, Counter())
                counts[seq[i]] += sign
                if counts[seq[i]] <= 0:
                    del counts[seq[i]]
                    if not counts:
                        del self._next[key]

    def propose(self, tokens: list[int], k: int) -> tuple[list[int], int]:
        """(up to ``k`` proposed tokens after ``tokens``, the context length matched first)."""
        out: list[int] = []
        seq = list(tokens[-self.n_max:])
        matched = 0
        while len(out) < k:
            for n in range(min(self.n_max, len(seq)), self.n_min - 1, -1):
                counts = self._next.get(tuple(seq[len(seq) - n:]))
                if counts:
                    break
            else:
                break
            token, count = counts.most_common(1)[0]
            if count < self.min_share * sum(counts.values()):
                break
            matched = matched or n
            out.append(token)
            seq = seq[1:] + [token] if len(seq) >= self.n_max else seq + [token]
        return out, matched
