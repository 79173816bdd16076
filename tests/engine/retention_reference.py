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


def prompt_mask_logprobs(hf_model, tokens, num_prompt_tokens: int,
                         kept: torch.Tensor) -> torch.Tensor:
    """log_softmax [L, vocab] of transformers over ``tokens``, every key kept, for a prompt
    compressed once (scope ``prompt``): the prompt's queries see every earlier key (it is
    prefilled in full); a later query sees the kept prompt keys (``kept`` [P] bool) and every
    token after the prompt up to itself."""
    n, p = len(tokens), num_prompt_tokens
    q, k = torch.arange(n)[:, None], torch.arange(n)[None, :]
    seen = torch.cat([kept, torch.ones(n - p, dtype=torch.bool)])[None, :]
    allowed = (k <= q) & ((q < p) | seen)
    mask = torch.zeros(n, n).masked_fill(~allowed, torch.finfo(torch.float32).min)
    with torch.no_grad():
        logits = hf_model(torch.tensor([tokens]), attention_mask=mask[None, None]).logits[0]
    return torch.log_softmax(logits.float(), -1)


def cache_position_logprobs(hf_model, tokens, spec: RetentionSpec,
                            chunks: list[tuple[int, int]]) -> torch.Tensor:
    """log_softmax [L, vocab] of transformers under window/sinks with positions in the cache
    (StreamingLLM's scheme), fed in the engine's ``chunks`` ((start, n) per step).

    For each chunk: the tokens held at its start (k < sinks or k > start - window) are laid
    at positions 0..m-1 in order: a fresh DynamicCache of their raw (never rotated) keys, as
    the k_proj hooks captured them when each token was computed, rotated by transformers' own
    RoPE to those positions, and their values; the chunk's queries at positions m..m+n-1,
    query q (a logical position) seeing key k when k <= q and (k < sinks or k > q - window).
    """
    from transformers import DynamicCache
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    layers = hf_model.model.layers
    raw: dict[str, list[list[torch.Tensor]]] = {"k": [[] for _ in layers],
                                                "v": [[] for _ in layers]}
    hooks = []
    for i, layer in enumerate(layers):
        for name, proj in (("k", layer.self_attn.k_proj), ("v", layer.self_attn.v_proj)):
            hooks.append(proj.register_forward_hook(
                lambda _m, _x, out, i=i, name=name: raw[name][i].append(out[0])))
    heads, dim = hf_model.config.num_key_value_heads, hf_model.config.head_dim
    rows = []
    try:
        for start, n in chunks:
            held = [p for p in range(start) if p < spec.sinks or p > start - spec.window]
            m = len(held)
            cache = DynamicCache()
            if m:
                cos, sin = hf_model.model.rotary_emb(torch.zeros(1), torch.arange(m)[None])
                for i in range(len(layers)):
                    k, v = (torch.cat(raw[x][i])[held].view(1, m, heads, dim).transpose(1, 2)
                            for x in ("k", "v"))
                    k = apply_rotary_pos_emb(k, k, cos, sin)[1]
                    cache.update(k, v, i)
            q = torch.arange(start, start + n)[:, None]
            key = torch.tensor(held + list(range(start, start + n)), dtype=torch.int64)[None, :]
            allowed = (key <= q) & ((key < spec.sinks) | (key > q - spec.window))
            mask = torch.zeros(n, m + n).masked_fill(~allowed, torch.finfo(torch.float32).min)
            with torch.no_grad():
                out = hf_model(torch.tensor([tokens[start: start + n]]),
                               position_ids=torch.arange(m, m + n)[None],
                               cache_position=torch.arange(m, m + n),
                               cache=cache, attention_mask=mask[None, None],
                               use_cache=True)
            rows.append(torch.log_softmax(out.logits[0].float(), -1))
    finally:
        for h in hooks:
            h.remove()
    return torch.cat(rows)


def per_head_mask_logprobs(hf_model, tokens, allowed: torch.Tensor) -> torch.Tensor:
    """log_softmax [L, vocab] of transformers over ``tokens`` with every key kept and a mask
    per (layer, KV head): ``allowed`` [layers, kv_heads, L, L] bool says which key each query
    of that layer and KV head sees (the query heads of a GQA group share it). An attention
    function registered with transformers' ``AttentionInterface`` applies it (SDPA, the same
    scale), so each layer gets its own mask."""
    import torch.nn.functional as F
    from transformers import AttentionInterface

    def attend(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
        group = query.shape[1] // key.shape[1]
        mask = allowed[module.layer_idx].repeat_interleave(group, 0)[None]  # [1, heads, L, L]
        out = F.scaled_dot_product_attention(query, key, value, attn_mask=mask, scale=scaling,
                                             enable_gqa=True)
        return out.transpose(1, 2).contiguous(), None

    AttentionInterface.register("kvledger_per_head_mask", attend)
    config = hf_model.config
    before = config._attn_implementation
    config._attn_implementation = "kvledger_per_head_mask"
    try:
        with torch.no_grad():
            logits = hf_model(torch.tensor([tokens])).logits[0]
    finally:
        config._attn_implementation = before
    return torch.log_softmax(logits.float(), -1)


def held_masks(states: list[tuple[int, torch.Tensor]], n: int, layers: int,
               kv_heads: int) -> torch.Tensor:
    """[layers, kv_heads, n, n] bool: what each query saw in a per-head engine run, from the
    held positions recorded before each step (``states``: (first position the step computes,
    pos [layers * kv_heads, slots], -1 = nothing), in order): a query at q sees the keys its
    step's rows held and the keys of its own step up to q."""
    allowed = torch.zeros(layers * kv_heads, n, n, dtype=torch.bool)
    starts = [s for s, _ in states] + [n]
    for (start, pos), end in zip(states, starts[1:]):
        for q in range(start, min(end, n)):
            for row in range(layers * kv_heads):
                held = pos[row][pos[row] >= 0]
                allowed[row, q, held] = True
            allowed[:, q, start: q + 1] = True
    return allowed.view(layers, kv_heads, n, n)


def eager_attentions(hf_model, tokens) -> tuple[torch.Tensor, ...]:
    """transformers' own attention probabilities of ``tokens`` (eager attention, one [1,
    heads, n, n] tensor per layer), the model's attention implementation restored after."""
    config = hf_model.config
    before = config._attn_implementation
    config._attn_implementation = "eager"
    try:
        with torch.no_grad():
            return hf_model(torch.tensor([list(tokens)]), output_attentions=True).attentions
    finally:
        config._attn_implementation = before
