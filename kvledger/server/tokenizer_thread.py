"""The tokenizer thread: tokenizing and chat templates, off the event loop and the engine thread.

On the event loop a 3 MB prompt's tokenizing froze every stream and ``/health`` for seconds;
in the engine thread it would pause every running request's steps. One dedicated worker
thread does it instead (Hugging Face fast tokenizers release the GIL while encoding), so the
event loop keeps serving and the engine keeps stepping. One thread, so the tokenizer and the
Responses API's retrieval index are used by one caller at a time.

A fast tokenizer's ``decode`` holds the GIL throughout (1.5 M ids: the event loop stood still
for its whole second); :func:`decode` calls its ``decode_batch``, which releases it, wherever
that gives the same text.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any


def decode(tokenizer, ids: list[int]) -> str:
    """``tokenizer.decode(ids)``, through the Rust tokenizer's GIL-free ``decode_batch`` when the
    tokenizer is a fast one that changes nothing after it (no clean-up of spaces)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None or getattr(tokenizer, "clean_up_tokenization_spaces", True):
        return tokenizer.decode(ids)
    return backend.decode_batch([ids], skip_special_tokens=False)[0]


class TokenizerThread:
    """Runs functions in the one tokenizer thread."""

    def __init__(self) -> None:
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="kvledger-tokenizer")

    async def run(self, fn: Callable[..., Any], *args: Any) -> Any:
        """``fn(*args)`` in the tokenizer thread; its result, or its exception raised here."""
        return await asyncio.get_running_loop().run_in_executor(self._pool, fn, *args)

    def close(self) -> None:
        """Stop taking work (queued calls are cancelled; the running one finishes)."""
        self._pool.shutdown(wait=False, cancel_futures=True)
