"""Prompt log-probabilities: vLLM's ``prompt_logprobs``, behind the completions API's ``echo``.

The logits at position p predict token p + 1. So a prompt of P tokens gets P entries: ``None``
for token 0, which nothing predicts, then the log-softmax at positions 0..P-2 taken at tokens
1..P-1. The raw model's distribution is used, before any sampling parameter, as vLLM does. Each
entry also has the token's rank and the top-k alternatives (k = ``prompt_logprobs``).

A chunk of a request whose entries are not all in yet wants the final hidden state of every
row (:func:`logit_rows`, which the runner's wanted rows follow). The runner turns the wanted
rows into logits :data:`SLICE_ROWS` at a time (:func:`logits_in_slices`) and hands each slice
to the step's :class:`PromptLogprobs`, which records the slice's entries at once (the token's
logprob, rank and top-k: a few numbers per row) and keeps only the rows that sample. So a
prompt of any length costs one slice of logits at a time, never [tokens, vocab], and it is
computed chunk by chunk inside the scheduler's token budget like any prefill. A preempted
request computes its prompt again and records nothing twice. Such a request reads no
prefix-cache hit, because the positions a hit skips would have no logits (vLLM v1 skips the
cache the same way); its own blocks still enter the cache for later requests.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from kvledger.engine.output.request_output import TokenLogprob

SLICE_ROWS = 128
"""Rows turned into logits together: 128 x vocab fp32 (25 MB at the bundled model's 49,152
tokens, 78 MB at 152,064)."""

SliceReducer = Callable[[int, torch.Tensor], torch.Tensor]
"""``reduce(first_row, logits)`` -> the rows of the slice to keep."""


def wants_prompt_logits(request, start: int) -> bool:
    """True when a chunk of ``request`` starting at position ``start`` holds a position whose
    logits give a prompt entry not recorded yet."""
    entries = request.output.prompt_logprobs
    return entries is not None and len(entries) < request.num_prompt_tokens and (
        start < request.num_prompt_tokens - 1)


def logit_rows(chunk) -> int:
    """Rows of ``chunk`` (``request``, ``num_new_tokens``) whose logits the step returns, its
    last rows: all of them while its request wants prompt logits, else its
    :func:`sample_rows`."""
    req, start = chunk.request, chunk.request.num_computed_tokens
    if wants_prompt_logits(req, start):
        return chunk.num_new_tokens
    return sample_rows(chunk)


def sample_rows(chunk) -> int:
    """Rows of ``chunk`` a token is sampled from, its last ones: 1 when it reaches its
    request's last token, plus one per proposed token it verifies (``draft``, speculative
    decoding); else 0."""
    req, draft = chunk.request, getattr(chunk, "draft", ())
    end = req.num_computed_tokens + chunk.num_new_tokens - len(draft)
    return (1 + len(draft)) * int(end == req.num_tokens)


def logits_in_slices(compute_logits: Callable[[torch.Tensor], torch.Tensor],
                     hidden: torch.Tensor, reduce: SliceReducer | None = None) -> torch.Tensor:
    """Logits of the rows ``hidden`` [N, hidden], computed :data:`SLICE_ROWS` rows at a time
    (every tensor-parallel rank runs the same slices: the LM head gathers); each slice goes
    through ``reduce`` when given, and what it keeps is concatenated."""
    if len(hidden) <= SLICE_ROWS and reduce is None:
        return compute_logits(hidden)
    kept = []
    for lo in range(0, max(len(hidden), 1), SLICE_ROWS):
        logits = compute_logits(hidden[lo: lo + SLICE_ROWS])
        kept.append(logits if reduce is None else reduce(lo, logits))
    return torch.cat(kept)


class PromptLogprobs:
    """One step's slice reducer (:data:`SliceReducer`): records the prompt entries of the
    wanted rows of ``chunks`` (before the step advances the requests) and keeps the rows that
    sample, in the order of ``chunks``."""

    def __init__(self, chunks: Sequence) -> None:
        self._rows: list[tuple | None] = []  # per wanted row: (request, position) or None
        self._sampling: list[int] = []
        for chunk in chunks:
            req, start = chunk.request, chunk.request.num_computed_tokens
            end, prompt = start + chunk.num_new_tokens, wants_prompt_logits(req, start)
            self._rows.extend((req, p) if prompt else None
                              for p in range(end - logit_rows(chunk), end))
            rows = len(self._rows)
            self._sampling.extend(range(rows - sample_rows(chunk), rows))

    def __call__(self, first: int, logits: torch.Tensor) -> torch.Tensor:
        rows = range(first, first + len(logits))
        run: list[int] = []
        for r in rows:
            if run and (self._rows[r] is None or self._rows[r][0] is not self._rows[run[0]][0]):
                self._record(run, logits[run[0] - first: run[-1] + 1 - first])
                run = []
            if self._rows[r] is not None:
                run.append(r)
        if run:
            self._record(run, logits[run[0] - first: run[-1] + 1 - first])
        return logits[[r - first for r in self._sampling if r in rows]]

    def _record(self, run: list[int], logits: torch.Tensor) -> None:
        """Append the entries the rows ``run`` (one request's consecutive positions) predict,
        skipping those recorded already (a recomputed prompt) and the last prompt token's."""
        req, start = self._rows[run[0]]
        entries, prompt = req.output.prompt_logprobs, req.prompt_token_ids
        lo = len(entries) - 1 - start  # rows already recorded
        assert lo >= 0, "prompt chunks are recorded in order"
        hi = min(len(run), len(prompt) - 1 - start)
        if lo >= hi:
            return
        logits = logits[lo:hi].float()
        lse = torch.logsumexp(logits, dim=-1)
        targets = torch.tensor(prompt[start + 1 + lo: start + 1 + hi], device=logits.device)
        chosen = logits.gather(1, targets[:, None])[:, 0]
        ranks = (logits > chosen[:, None]).sum(dim=1) + 1
        k = req.params.prompt_logprobs
        top = torch.topk(logits, k) if k else None
        values = (chosen - lse).tolist()
        for i, token in enumerate(targets.tolist()):
            alternatives = [] if top is None else list(zip(
                top.indices[i].tolist(), (top.values[i] - lse[i]).tolist()))
            entries.append(TokenLogprob(token, values[i], alternatives, int(ranks[i])))
