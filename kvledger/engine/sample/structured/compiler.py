"""GrammarCompiler: constraints compiled into llguidance matchers off the engine thread, cached.

One compiler per engine (one tokenizer). :meth:`GrammarCompiler.submit` compiles in a worker
thread and returns a future; the compiled form (a pristine ``LLMatcher``, or the error that
refuses the constraint) is kept in an LRU cache keyed by ``StructuredOutputsParams.key``, so a
schema compiles once. :meth:`GrammarCompiler.matcher` hands each request its own copy
(``deep_copy``: microseconds). The llguidance tokenizer (the vocabulary's token trie, about 2 s
for 49,152 ids) is built once, in the worker thread, on the first constraint.
"""

from __future__ import annotations

import concurrent.futures
import threading
from collections import OrderedDict

from kvledger.engine.sample.structured.constraint import StructuredOutputsParams
from kvledger.errors import InvalidParameterError

CACHE_SIZE = 256  # compiled constraints kept
MASK_THREADS = 2  # llguidance threads filling one step's masks


class GrammarCompiler:
    """Compiles and caches constraints for one tokenizer.

    Args:
        tokenizer: a transformers fast tokenizer.
        vocab_size: rows of the model's logits (masks cover this many ids).
        eos_token_ids: the ids that end generation (allowed once a grammar is complete).
    """

    def __init__(self, tokenizer, vocab_size: int, eos_token_ids) -> None:
        self._tokenizer = tokenizer
        self.vocab_size = vocab_size
        self._eos = sorted(eos_token_ids)
        self._lltokenizer = None
        self._executor = None
        self._cache: OrderedDict[str, concurrent.futures.Future] = OrderedDict()
        self._lock = threading.Lock()
        self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="kvl-grammar")

    def submit(self, constraint: StructuredOutputsParams) -> concurrent.futures.Future:
        """A future of the compiled constraint (done at once when cached); its exception is
        the InvalidParameterError that refuses the constraint."""
        key = constraint.key
        with self._lock:
            future = self._cache.get(key)
            if future is None:
                future = self._pool.submit(self._compile, constraint)
                self._cache[key] = future
                while len(self._cache) > CACHE_SIZE:
                    self._cache.popitem(last=False)
            else:
                self._cache.move_to_end(key)
        return future

    def matcher(self, constraint: StructuredOutputsParams):
        """A fresh matcher for one request (waits for the compile when it is not cached).

        Raises:
            InvalidParameterError: the constraint does not compile (an unsupported JSON
                Schema feature is named).
        """
        return self.submit(constraint).result().deep_copy()

    @property
    def executor(self):
        """The llguidance executor that fills a step's masks in parallel."""
        if self._executor is None:
            from llguidance import LLExecutor

            self._executor = LLExecutor(num_threads=MASK_THREADS)
        return self._executor

    def _compile(self, constraint: StructuredOutputsParams):
        from llguidance import LLMatcher

        grammar = constraint.grammar_text()
        tokenizer = self._llg_tokenizer()
        try:
            matcher = LLMatcher(tokenizer, grammar, log_level=0)
        except BaseException as exc:  # a Rust panic arrives as pyo3's PanicException
            if not isinstance(exc, Exception) and type(exc).__name__ != "PanicException":
                raise
            raise InvalidParameterError(f"the {constraint.label} cannot be compiled: "
                                        f"{_one_line(str(exc))}") from None
        if matcher.is_error():
            raise InvalidParameterError(f"the {constraint.label} cannot be enforced: "
                                        f"{_one_line(matcher.get_error())}")
        return matcher

    def _llg_tokenizer(self):
        if self._lltokenizer is None:
            from llguidance.hf import from_tokenizer

            self._lltokenizer = from_tokenizer(self._tokenizer, n_vocab=self.vocab_size,
                                               eos_token=self._eos)
        return self._lltokenizer


def _one_line(message: str) -> str:
    """llguidance's message on one line (its caret lines dropped), at most 300 characters."""
    lines = [line.strip() for line in message.splitlines()]
    return " ".join(line for line in lines if line.strip("^ "))[:300] or "invalid"
