"""A request's ``max_tokens_effective`` under the admission rule (``ledger/admission.py``, the
one place it is computed), or the error naming the limit the request passes: the context
(ContextLengthError), the per-request KV quota or the pool and its long-request share
(KVBudgetError). ``Scheduler.add`` asks it before a request is queued.
"""

from __future__ import annotations

from kvledger.engine.request import Request
from kvledger.errors import ContextLengthError, KVBudgetError
from kvledger.ledger.admission import RequestBudget


def max_tokens_effective(req: Request, budget: RequestBudget, bytes_per_block: int) -> int:
    """``req.params.max_tokens``, or the room ``budget`` leaves when it is None (``req.is_long``
    already set: it names the long-request share in the message); ``bytes_per_block`` is the
    ledger's, for the message.

    Raises:
        ContextLengthError: prompt + max_tokens passes the context, or the prompt leaves no
            room for one new token.
        KVBudgetError: prompt + max_tokens passes the per-request quota, or its largest KV
            the pool (or its long-request share).
    """
    prompt, asked = req.num_prompt_tokens, req.params.max_tokens
    context, spec = budget.context_tokens, req.retention.spec
    if budget.exceeded_by(prompt + 1, spec, prompt) == "context":  # no room for a token
        raise ContextLengthError(
            f"this model's maximum context length is {context} tokens, but the prompt has "
            f"{prompt} tokens (max_tokens {'up to the limit' if asked is None else asked}; "
            "no room for one new token)")
    if asked is None:
        room = budget.max_total_tokens - prompt
        if room < 1:
            raise KVBudgetError(
                f"the prompt has {prompt} tokens and leaves no room for one new token "
                "within the KV quota or pool (--max-kv-tokens-per-request, --kv-cache-gib)")
        return room
    total = prompt + asked
    limit = budget.exceeded_by(total, spec, prompt)
    if limit == "context":
        raise ContextLengthError(
            f"this model's maximum context length is {context} tokens; the prompt has "
            f"{prompt} tokens and max_tokens is {asked} ({total} in total); shorten the "
            "prompt or lower max_tokens")
    what = f"request {req.request_id!r} (prompt {prompt} + max_tokens {asked} = {total} tokens)"
    if limit == "quota":
        raise KVBudgetError(
            f"{what} exceeds the per-request KV quota of {budget.quota_tokens} tokens "
            "(--max-kv-tokens-per-request); lower max_tokens or shorten the prompt")
    if limit == "kv":
        kv_tokens = spec.max_kv_tokens(prompt, total)
        blocks = budget.kv_blocks_of(total, spec, prompt)
        cap, bpb = budget.max_blocks, bytes_per_block
        where = "the long-request share of the KV pool" if req.is_long else "the KV pool"
        raise KVBudgetError(
            f"{what} needs up to {kv_tokens} KV tokens = {blocks} blocks "
            f"({blocks * bpb} bytes) but {where} holds {cap} blocks ({cap * bpb} bytes); "
            "lower max_tokens or raise --kv-cache-gib / --num-blocks")
    return asked
