"""The mask-only reference of the retention tests: transformers with every key kept and the
dropped keys hidden by a 4-D attention mask, at the same positions (imported by basename, as
``sched_harness``, from tests/engine and its subfolders)."""

from __future__ import annotations

import torch

from kvledger.ledger.retention import RetentionSpec


def mask_only_logprobs(hf_model, tokens, spec: RetentionSpec) -> torch.Tensor:
    """log_softmax [L, vocab] of transformers over ``tokens``, every key kept, key k hidden
    from query q unless k <= q and (k < sinks or k > q - window)."""
    n = len(tokens)
    q, k = torch.arange(n)[:, None], torch.arange(n)[None, :]
    allowed = (k <= q) & ((k < spec.sinks) | (k > q - spec.window))
    mask = torch.zeros(n, n).masked_fill(~allowed, torch.finfo(torch.float32).min)
    with torch.no_grad():
        logits = hf_model(torch.tensor([tokens]), attention_mask=mask[None, None]).logits[0]
    return torch.log_softmax(logits.float(), -1)
