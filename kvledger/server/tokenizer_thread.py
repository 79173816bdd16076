"""The tokenizer thread: tokenizing and chat templates, off the event loop and the engine thread.

On the event loop a 3 MB prompt's tokenizing froze every stream and ``/health`` for seconds;
in the engine thread it would pause every running request's steps. One dedicated worker
thread does it instead (Hugging Face fast tokenizers release the GIL while encoding), so the
event loop keeps serving and the engine keeps stepping. One thread, so the tokenizer and the
Responses API's retrieval index are used by one caller at a time.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any


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
