"""Token sampling: greedy, temperature, top-k, top-p (nucleus), per-request seeded generators.

Top-p: Holtzman et al., "The Curious Case of Neural Text Degeneration" (arXiv:1904.09751): keep
the smallest set of most likely tokens whose probability mass reaches p. Logprobs are those of
the model's raw distribution (log-softmax of the logits, before temperature), as vLLM returns.
"""

from __future__ import annotations

import torch

from kvledger.engine.outputs import TokenLogprob
from kvledger.engine.sampling_params import SamplingParams


class Sampler:
    """Picks one token per row of logits, each row with its own SamplingParams."""

    def __init__(self) -> None:
        self._generators: dict[str, torch.Generator] = {}

    def sample(self, logits: torch.Tensor, request_ids: list[str],
               params: list[SamplingParams]) -> tuple[list[int], list[TokenLogprob | None]]:
        """Token ids and (when asked) logprobs for logits [N, vocab] fp32."""
        tokens = [self._pick(row, rid, p) for row, rid, p in zip(logits, request_ids, params)]
        logprobs = [_logprobs(row, tok, p.logprobs) if p.logprobs is not None else None
                    for row, tok, p in zip(logits, tokens, params)]
        return tokens, logprobs

    def forget(self, request_id: str) -> None:
        """Drop a finished request's generator."""
        self._generators.pop(request_id, None)

    def _pick(self, logits: torch.Tensor, request_id: str, p: SamplingParams) -> int:
        if p.greedy:
            return int(torch.argmax(logits))
        scaled = logits / p.temperature
        if p.top_k > 0:
            kth = torch.topk(scaled, min(p.top_k, scaled.numel())).values[-1]
            scaled = scaled.masked_fill(scaled < kth, float("-inf"))
        probs = torch.softmax(scaled, dim=-1)
        if p.top_p < 1.0:
            probs = _nucleus(probs, p.top_p)
        total = float(probs.sum())
        if not total > 0 or total == float("inf"):  # underflow/overflow: the limit is greedy
            return int(torch.argmax(logits))
        return int(torch.multinomial(probs, 1, generator=self._generator(request_id, p)))

    def _generator(self, request_id: str, p: SamplingParams) -> torch.Generator | None:
        if p.seed is None:
            return None
        if request_id not in self._generators:
            self._generators[request_id] = torch.Generator().manual_seed(p.seed)
        return self._generators[request_id]


def _nucleus(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """Zero every token outside the smallest top set whose mass reaches ``top_p``."""
    sorted_probs, order = torch.sort(probs, descending=True)
    mass_before = torch.cumsum(sorted_probs, dim=-1) - sorted_probs
    sorted_probs[mass_before >= top_p] = 0.0
    return torch.zeros_like(probs).scatter_(-1, order, sorted_probs)


def _logprobs(logits: torch.Tensor, token: int, k: int) -> TokenLogprob:
    logp = torch.log_softmax(logits, dim=-1)
    top = torch.topk(logp, k) if k > 0 else None
    alternatives = [] if top is None else list(zip(top.indices.tolist(), top.values.tolist()))
    return TokenLogprob(token_id=token, logprob=float(logp[token]), top=alternatives)
