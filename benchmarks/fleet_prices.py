"""The step prices of ``bench_fleet.py``'s replicas, measured in the same run: what
``kvledger plan --replicas --step-prices`` is fed, so that the plan prices the steps the replicas
take on this machine as it is loaded now, not a fit made at another hour.

Every replica is measured at once (each busy, as in the routed run), over HTTP with token-id
prompts no other request shares (no prefix hit):

- per prefilled token: the latency of a one-token answer to a prompt of the mix's length less
  that to a 16-token prompt, over the difference in tokens (median of ``rounds``);
- a decode step of one sequence ``d1``, and of ``max_num_seqs`` sequences ``db``, at the mix's
  context: the time from a stream's first token to its last over the steps between, with one
  stream, then with ``max_num_seqs`` streams at once, each a prefix of the mix's (sent once
  before, so that it is cached) and its own question: as in the run, they share the prefix's
  blocks, so ``max_num_seqs`` of them fit the pool;
- ``decode_seq_s = (db - d1) / (max_num_seqs - 1)`` and ``step_s = d1 - decode_seq_s``, the
  plan's two decode prices (``ledger/fleet.py``);
- per request, what the steps leave out (HTTP, tokenizing, scheduling, the prefill step's
  fixed part): the 16-token answer's latency less its 16 prefilled tokens and one step.

The replicas' figures are averaged.
"""

from __future__ import annotations

import asyncio
import statistics
import time
from collections.abc import Callable

import httpx

SHORT = 16  # tokens of the short prompts
STREAM_TOKENS = 32  # output tokens of the decode streams
OFFSET = 20_000  # pydoc tokens from here on: no workload prompt reaches this far


async def _request(client: httpx.AsyncClient, url: str, model: str, prompt: list[int],
                   max_tokens: int) -> tuple[float, float, float]:
    """(start, first token, last token) times of one streamed completion."""
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "stream": True,
            "temperature": 0.0, "ignore_eos": True}
    start = time.perf_counter()
    first = last = None
    async with client.stream("POST", url + "/v1/completions", json=body) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if line.startswith("data:") and '"text"' in line:
                last = time.perf_counter()
                first = first or last
    return start, first, last


async def _replica(url: str, model: str, texts: list[list[int]], prefix_tokens: int,
                   prompt_tokens: int, seqs: int, rounds: int) -> dict[str, float]:
    take = iter(texts)
    async with httpx.AsyncClient(timeout=600) as client:
        short, long_ = [], []
        for _ in range(rounds):
            s, _, end = await _request(client, url, model, next(take)[:SHORT], 1)
            short.append(end - s)
            s, _, end = await _request(client, url, model, next(take)[:prompt_tokens], 1)
            long_.append(end - s)

        prefix = next(take)[:prefix_tokens]
        await _request(client, url, model, prefix, 1)

        async def decode_step(n: int) -> float:
            own = prompt_tokens - prefix_tokens
            runs = await asyncio.gather(*(_request(client, url, model,
                                                   prefix + next(take)[:own], STREAM_TOKENS)
                                          for _ in range(n)))
            return statistics.mean((last - first) / (STREAM_TOKENS - 1)
                                   for _, first, last in runs)

        d1, db = await decode_step(1), await decode_step(seqs)
    per_seq = max(0.0, (db - d1) / (seqs - 1)) if seqs > 1 else 0.0
    per_token = max(0.0, (statistics.median(long_) - statistics.median(short))
                    / (prompt_tokens - SHORT))
    return {"prefill_token_s": per_token, "step_s": max(d1 - per_seq, 1e-6),
            "decode_seq_s": per_seq,
            "request_s": max(0.0, statistics.median(short) - SHORT * per_token - d1)}


def measure(urls: list[str], model: str, cut: Callable[[int, int], list[int]],
            prefix_tokens: int, prompt_tokens: int, seqs: int, rounds: int = 3) -> dict:
    """The replicas' step prices (module docstring): ``{"prices": {...}, "per_replica": [...]}``;
    ``cut(n, offset)`` gives ``n`` token ids of text from ``offset`` on."""
    need = 2 * rounds + 2 + seqs
    per = prompt_tokens + 1

    def texts(i: int) -> list[list[int]]:
        base = OFFSET + i * need * per
        return [cut(per, base + k * per) for k in range(need)]

    async def all_() -> list[dict]:
        return await asyncio.gather(*(_replica(u, model, texts(i), prefix_tokens, prompt_tokens,
                                               seqs, rounds) for i, u in enumerate(urls)))

    found = asyncio.run(all_())
    prices = {k: statistics.mean(f[k] for f in found) for k in found[0]}
    return {"prices": prices, "per_replica": found}
