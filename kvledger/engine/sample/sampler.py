"""Token sampling: greedy, temperature, top-k, top-p (nucleus), per-request seeded generators.

Before a token is picked, the step's logits go through :mod:`.penalties` in one batch (logit
bias, repetition / frequency / presence penalties) and then the grammar masks of the requests
with structured output (:mod:`.structured.masks`); greedy takes the argmax of the processed
logits and min-p filters the tempered distribution, as in vLLM.

Top-p: Holtzman et al., "The Curious Case of Neural Text Degeneration" (arXiv:1904.09751): keep
the smallest set of most likely tokens whose probability mass reaches p. Logprobs are those of
the model's raw distribution (log-softmax of the logits, before temperature), as vLLM returns.
"""

from __future__ import annotations

import torch

from kvledger.engine.output.request_output import TokenLogprob
from kvledger.engine.request import Request
from kvledger.engine.sample.penalties import apply_min_p, apply_penalties
from kvledger.engine.sample.structured.masks import apply_grammar_masks


class Sampler:
    """Picks one token per row of logits, each row with its request's SamplingParams, seeded
    generator (``Request.generator``) and grammar (``Request.grammar``); it keeps no
    per-request state of its own.

    Logits on a device (a GPU) are processed there and the greedy picks come back in one copy
    of the step's token ids; a sampled row is copied back and drawn on the CPU with its
    request's generator (a CPU ``torch.Generator``), so a seed draws the same token as on the
    CPU device.

    Args:
        grammars: the engine's ``GrammarCompiler`` (None: no request has a grammar).
    """

    def __init__(self, grammars=None) -> None:
        self.grammars = grammars

    def sample(self, logits: torch.Tensor, requests: list[Request]
               ) -> tuple[list[int], list[TokenLogprob | None]]:
        """Token ids and (when asked) logprobs for logits [N, vocab] fp32, row i for
        ``requests[i]``."""
        processed = self.processed(logits, requests)
        argmax = torch.argmax(processed, dim=-1).tolist()  # the greedy picks, one copy back
        tokens = [argmax[i] if req.params.greedy else self._pick(processed[i].cpu(), req)
                  for i, req in enumerate(requests)]
        logprobs = [token_logprob(row, tok, req.params.logprobs)
                    if req.params.logprobs is not None else None
                    for row, tok, req in zip(logits, tokens, requests)]
        return tokens, logprobs

    def processed(self, logits: torch.Tensor, requests: list[Request]) -> torch.Tensor:
        """Logits [N, vocab] after the penalties and the grammar masks, row i for
        ``requests[i]`` (what a token is picked from)."""
        processed = apply_penalties(logits, [r.params for r in requests],
                                    [r.prompt_token_ids for r in requests],
                                    [r.output_token_ids for r in requests])
        if self.grammars is not None:
            processed = apply_grammar_masks(processed, requests, self.grammars)
        return processed

    @staticmethod
    def distribution(logits: torch.Tensor, req: Request) -> torch.Tensor | None:
        """The (unnormalised) distribution a sampled token is drawn from, for one row of
        processed logits: temperature, top-k, min-p, top-p; None when the pick is the argmax
        (greedy, or a distribution that under- or overflowed: its limit is greedy)."""
        p = req.params
        if p.greedy:
            return None
        scaled = logits / p.temperature
        if p.top_k > 0:
            kth = torch.topk(scaled, min(p.top_k, scaled.numel())).values[-1]
            scaled = scaled.masked_fill(scaled < kth, float("-inf"))
        probs = apply_min_p(torch.softmax(scaled, dim=-1), p.min_p)
        if p.top_p < 1.0:
            probs = _nucleus(probs, p.top_p)
        total = float(probs.sum())
        if not total > 0 or total == float("inf"):
            return None
        return probs

    def _pick(self, logits: torch.Tensor, req: Request) -> int:
        probs = self.distribution(logits, req)
        if probs is None:
            return int(torch.argmax(logits))
        return int(torch.multinomial(probs, 1, generator=req.generator))


def _nucleus(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """Zero every token outside the smallest top set whose mass reaches ``top_p``."""
    sorted_probs, order = torch.sort(probs, descending=True)
    mass_before = torch.cumsum(sorted_probs, dim=-1) - sorted_probs
    sorted_probs[mass_before >= top_p] = 0.0
    return torch.zeros_like(probs).scatter_(-1, order, sorted_probs)


def token_logprob(logits: torch.Tensor, token: int, k: int) -> TokenLogprob:
    logp = torch.log_softmax(logits, dim=-1)
    top = torch.topk(logp, k) if k > 0 else None
    alternatives = [] if top is None else list(zip(top.indices.tolist(), top.values.tolist()))
    return TokenLogprob(token_id=token, logprob=float(logp[token]), top=alternatives)
