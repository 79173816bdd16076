"""Accepting or rejecting one proposed token against the target model's distribution.

Greedy: the token is the argmax of the processed logits; a proposal is accepted iff it is that
token, so the output is the one plain decoding gives.

Sampling: speculative (rejection) sampling, Leviathan et al. 2023 (arXiv:2211.17192,
Algorithm 1) and Chen et al. 2023 (arXiv:2302.01318): with the target distribution ``p`` (after
temperature, top-k, min-p, top-p, penalties and the grammar mask) and the proposer's ``q``,
accept the proposal ``x`` with probability ``min(1, p(x) / q(x))``, else draw from
``norm(max(0, p - q))``. Our proposers are deterministic, ``q`` one-hot at ``x``: accept with
probability ``p(x)``, else draw from ``p`` with ``x`` removed. The emitted token is then
distributed exactly as ``p``: ``P(x) = p(x) + (1 - p(x)) * 0 = p(x)`` and, for ``y != x``,
``P(y) = (1 - p(x)) * p(y) / (1 - p(x)) = p(y)``. Draws use the request's seeded generator,
so a seeded run is reproducible.
"""

from __future__ import annotations

import torch

from kvledger.engine.request import Request
from kvledger.engine.sample.sampler import Sampler


def verify_token(sampler: Sampler, logits: torch.Tensor, req: Request,
                 proposal: int | None) -> int:
    """The token emitted at a position of ``req`` whose raw logits are ``logits`` [1, vocab],
    given the proposed token there (None: the verify's last position, a plain draw)."""
    row = sampler.processed(logits, [req])[0]
    probs = sampler.distribution(row, req)
    if probs is None:
        return int(torch.argmax(row))
    if proposal is not None:
        p = probs / probs.sum()
        if float(torch.rand((), generator=req.generator)) < float(p[proposal]):
            return proposal
        probs = probs.clone()
        probs[proposal] = 0.0
        if not float(probs.sum()) > 0:  # p was one-hot at the proposal: it is accepted above
            return proposal
    return int(torch.multinomial(probs, 1, generator=req.generator))
