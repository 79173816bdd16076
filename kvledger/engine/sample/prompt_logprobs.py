"""Prompt log-probabilities: vLLM's ``prompt_logprobs``, behind the completions API's ``echo``.

The logits at position p predict token p + 1. So a prompt of P tokens gets P entries: ``None``
for token 0, which nothing predicts, then the log-softmax at positions 0..P-2 taken at tokens
1..P-1. The raw model's distribution is used, before any sampling parameter, as vLLM does. Each
entry also has the token's rank and the top-k alternatives (k = ``prompt_logprobs``).

A chunk of a request whose entries are not all in yet has the logits of every row computed
(:func:`logit_rows`, which the runner's wanted rows follow). The engine records them with
:func:`take_prompt_logprobs` before sampling. A preempted request computes its prompt again
and records nothing twice. Such a request reads no prefix-cache hit, because the positions a
hit skips would have no logits (vLLM v1 skips the cache the same way); its own blocks still
enter the cache for later requests.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kvledger.engine.output.request_output import TokenLogprob


def wants_prompt_logits(request, start: int) -> bool:
    """True when a chunk of ``request`` starting at position ``start`` holds a position whose
    logits give a prompt entry not recorded yet."""
    entries = request.output.prompt_logprobs
    return entries is not None and len(entries) < request.num_prompt_tokens and (
        start < request.num_prompt_tokens - 1)


def logit_rows(chunk) -> int:
    """Rows of ``chunk`` (``request``, ``num_new_tokens``) whose logits the step returns, its
    last rows: all of them while its request wants prompt logits, else 1 when it reaches the
    request's last token (it samples), else 0."""
    req, start = chunk.request, chunk.request.num_computed_tokens
    if wants_prompt_logits(req, start):
        return chunk.num_new_tokens
    return int(start + chunk.num_new_tokens == req.num_tokens)


def take_prompt_logprobs(chunks: Sequence, logits: torch.Tensor) -> torch.Tensor:
    """Record the prompt entries found in ``logits`` (the rows of :func:`logit_rows`, chunk by
    chunk, before the step advances the requests); return the sampling rows [N, vocab]."""
    row, sampling = 0, []
    for chunk in chunks:
        n = logit_rows(chunk)
        req, start = chunk.request, chunk.request.num_computed_tokens
        if n and wants_prompt_logits(req, start):
            _record(req, start, logits[row: row + n])
        if start + chunk.num_new_tokens == req.num_tokens:
            sampling.append(row + n - 1)
        row += n
    return logits if len(sampling) == row else logits[sampling]


def _record(req, start: int, logits: torch.Tensor) -> None:
    """Append the entries of tokens ``start + 1 ..`` (prompt tokens not recorded yet)."""
    entries, prompt = req.output.prompt_logprobs, req.prompt_token_ids
    first = len(entries) - 1 - start  # rows already recorded (a recomputed prompt)
    assert first >= 0, "prompt chunks are recorded in order"
    last = min(len(logits), len(prompt) - 1 - start)
    if first >= last:
        return
    logp = torch.log_softmax(logits[first:last].float(), dim=-1)
    targets = torch.tensor(prompt[start + 1 + first: start + 1 + last])
    chosen = logp.gather(1, targets[:, None])[:, 0]
    ranks = (logp > chosen[:, None]).sum(dim=1) + 1
    k = req.params.prompt_logprobs
    top = torch.topk(logp, k) if k else None
    for i, token in enumerate(targets.tolist()):
        alternatives = [] if top is None else list(zip(top.indices[i].tolist(),
                                                       top.values[i].tolist()))
        entries.append(TokenLogprob(token, float(chosen[i]), alternatives, int(ranks[i])))
