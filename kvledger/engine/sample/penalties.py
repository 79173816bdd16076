"""Batched logit processing before sampling: logit bias, repetition / presence / frequency
penalties, and the min-p filter.

Applied to the logits ``[N, vocab]`` of one step, one row per request, in vLLM's order:
logit bias, then penalties, then (after temperature) min-p; greedy decoding takes the argmax of
the penalised logits, as in vLLM. Rows whose parameters are neutral are left bit-identical.

- ``logit_bias`` (OpenAI): ``logits[t] += bias[t]`` for each listed token id.
- ``presence_penalty`` / ``frequency_penalty`` (OpenAI's documented formula):
  ``logits[t] -= frequency * count[t] + presence * (count[t] > 0)``, ``count`` over the
  request's generated tokens.
- ``repetition_penalty`` (Keskar et al., CTRL, arXiv:1909.05858, as in vLLM and transformers):
  for every token seen in the prompt or the output, ``logits[t] / r`` if positive, else
  ``logits[t] * r``.
- ``min_p`` (Nguyen et al., arXiv:2407.01082): after temperature, drop tokens whose probability
  is below ``min_p`` times the most likely token's.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kvledger.engine.sample.sampling_params import SamplingParams


def _token_mask(n: int, vocab: int, token_lists: Sequence[Sequence[int]], rows: list[int],
                device: torch.device, counts: bool) -> torch.Tensor:
    """``[n, vocab]`` counts (float) or presence (bool) of each row's tokens."""
    row_idx = torch.tensor([r for r in rows for _ in token_lists[r]], dtype=torch.long,
                           device=device)
    tok_idx = torch.tensor([t for r in rows for t in token_lists[r]], dtype=torch.long,
                           device=device)
    if counts:
        out = torch.zeros(n, vocab, dtype=torch.float32, device=device)
        return out.index_put_((row_idx, tok_idx), torch.ones(len(tok_idx), device=device),
                              accumulate=True)
    out = torch.zeros(n, vocab, dtype=torch.bool, device=device)
    return out.index_put_((row_idx, tok_idx),
                          torch.ones(len(tok_idx), dtype=torch.bool, device=device))


def apply_penalties(logits: torch.Tensor, params: Sequence[SamplingParams],
                    prompt_ids: Sequence[Sequence[int]],
                    output_ids: Sequence[Sequence[int]]) -> torch.Tensor:
    """Logit bias and repetition / frequency / presence penalties, batched.

    Args:
        logits: ``[N, vocab]`` fp32, row i for the request with ``params[i]``.
        prompt_ids, output_ids: each row's prompt and generated token ids.

    Returns:
        ``logits`` itself when no row asks for any of them, else a new ``[N, vocab]`` tensor.
    """
    n, vocab = logits.shape
    bias_rows = [i for i, p in enumerate(params) if p.logit_bias]
    freq_rows = [i for i, p in enumerate(params)
                 if (p.frequency_penalty or p.presence_penalty) and output_ids[i]]
    rep_rows = [i for i, p in enumerate(params) if p.repetition_penalty != 1.0]
    if not (bias_rows or freq_rows or rep_rows):
        return logits
    logits = logits.clone()
    if bias_rows:
        on = logits.device
        rows = torch.tensor([i for i in bias_rows for _ in params[i].logit_bias], device=on)
        toks = torch.tensor([t for i in bias_rows for t in params[i].logit_bias], device=on)
        vals = torch.tensor([v for i in bias_rows for v in params[i].logit_bias.values()],
                            dtype=logits.dtype, device=on)
        logits.index_put_((rows, toks), vals, accumulate=True)
    if rep_rows:
        seen_lists = [list(prompt_ids[i]) + list(output_ids[i]) for i in range(n)]
        seen = _token_mask(n, vocab, seen_lists, rep_rows, logits.device, counts=False)
        r = torch.tensor([p.repetition_penalty for p in params], dtype=logits.dtype,
                            device=logits.device)[:, None]
        penalised = torch.where(logits > 0, logits / r, logits * r)
        logits = torch.where(seen, penalised, logits)
    if freq_rows:
        counts = _token_mask(n, vocab, output_ids, freq_rows, logits.device, counts=True)
        freq = torch.tensor([p.frequency_penalty for p in params], dtype=logits.dtype,
                            device=logits.device)[:, None]
        pres = torch.tensor([p.presence_penalty for p in params], dtype=logits.dtype,
                            device=logits.device)[:, None]
        logits = logits - freq * counts - pres * (counts > 0).to(logits.dtype)
    return logits


def apply_min_p(probs: torch.Tensor, min_p: float) -> torch.Tensor:
    """Zero the probabilities ``[..., vocab]`` below ``min_p`` x the largest (min_p in [0, 1])."""
    if min_p <= 0.0:
        return probs
    threshold = min_p * probs.max(dim=-1, keepdim=True).values
    return probs.masked_fill(probs < threshold, 0.0)
