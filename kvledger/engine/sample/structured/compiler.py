"""GrammarCompiler: constraints compiled into llguidance matchers off the engine thread, cached.

One compiler per engine (one tokenizer). :meth:`GrammarCompiler.submit` checks the constraint's
size (:mod:`.limits`), then compiles it in a worker thread and returns a future; the compiled
form (a pristine ``LLMatcher``) is kept in a :class:`~.cache.GrammarCache` keyed by
``StructuredOutputsParams.key`` within a byte budget, so a schema compiles once; a constraint
that fails is never kept. :meth:`GrammarCompiler.matcher` hands each request its own copy
(``deep_copy``: microseconds). The llguidance tokenizer (the vocabulary's token trie, about 2 s
for 49,152 ids) is built once, in the worker thread, on the first constraint.

The worker also computes the first token mask of two copies: the lexer states the first builds
are shared by every copy, so the engine thread never pays for them (``((a{100}){100}){100}``
took 1.6 s); a constraint whose language is empty (no output can match it), or whose shared
lexer already ran into llguidance's limits (every later copy would fail: ``too many expressions
constructed``), is refused there, at compile time. A compiled form whose request's matcher
fails later is dropped from the cache (:meth:`GrammarCompiler.discard`). The lexer's start-up work and its states are bounded (:data:`LEXER_FUEL`,
:data:`LEXER_STATES`: at most about 100 MB per constraint), and llguidance's verbose
errors (parser-state dumps) are off: a refusal says what is wrong in one line of ours.
"""

from __future__ import annotations

import concurrent.futures
import os

import numpy as np

from kvledger.engine.sample.structured.cache import GrammarCache
from kvledger.engine.sample.structured.constraint import StructuredOutputsParams
from kvledger.engine.sample.structured.limits import GrammarLimits
from kvledger.errors import InvalidParameterError

MASK_THREADS = 2  # llguidance threads filling one step's masks
LEXER_FUEL = 300_000  # llguidance's initial_lexer_fuel (its default 1,000,000: 1.6 s, +177 MB)
LEXER_STATES = 50_000  # llguidance's max_lexer_states, 1-2 kB each (its default 250,000)
BYTES_PER_GRAMMAR_CHAR = 32  # least estimate of a compiled grammar's memory (20,000-string
# enum: 349 KB of grammar, about 11 MB compiled)
NO_TOKEN_ERROR = "NoExtensionBias"  # llguidance's error when no token can start the output
CACHE_SHARE_OF_RAM = 64  # default cache budget: this fraction of RAM ...
CACHE_MAX_DEFAULT = 1 << 30  # ... at most 1 GiB


def default_cache_bytes() -> int:
    """The grammar cache's default budget: 1/64 of physical memory, at most 1 GiB."""
    try:
        ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError):
        return CACHE_MAX_DEFAULT
    return min(ram // CACHE_SHARE_OF_RAM, CACHE_MAX_DEFAULT)


def grammar_limits(config) -> GrammarLimits:
    """The size limits of an ``EngineConfig``'s ``max_grammar_*`` / ``max_schema_*`` options."""
    return GrammarLimits(config.max_grammar_bytes, config.max_schema_properties,
                         config.max_grammar_alternatives)


def grammar_cache_bytes(config) -> int:
    """The cache budget of an ``EngineConfig`` (``grammar_cache_mib``, else the default)."""
    mib = config.grammar_cache_mib
    return default_cache_bytes() if mib is None else mib << 20


class GrammarCompiler:
    """Compiles and caches constraints for one tokenizer.

    Args:
        tokenizer: a transformers fast tokenizer.
        vocab_size: rows of the model's logits (masks cover this many ids).
        eos_token_ids: the ids that end generation (allowed once a grammar is complete).
        limits: the size limits checked before compiling.
        cache_bytes: the cache's byte budget (None: :func:`default_cache_bytes`).
    """

    def __init__(self, tokenizer, vocab_size: int, eos_token_ids,
                 limits: GrammarLimits | None = None, cache_bytes: int | None = None) -> None:
        self._tokenizer = tokenizer
        self.vocab_size = vocab_size
        self._eos = sorted(eos_token_ids)
        self.limits = limits or GrammarLimits()
        self.cache = GrammarCache(default_cache_bytes() if cache_bytes is None else cache_bytes)
        self._lltokenizer = None
        self._executor = None
        self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="kvl-grammar")

    def submit(self, constraint: StructuredOutputsParams,
               tenant: str | None = None) -> concurrent.futures.Future:
        """A future of the compiled constraint (done at once when cached); its exception is
        the InvalidParameterError that refuses the constraint. ``tenant`` owns the cache entry
        a compile adds.

        Raises:
            GrammarTooLargeError: the constraint is over a size limit (checked at once).
        """
        self.limits.check(constraint)
        key = constraint.key

        def start() -> concurrent.futures.Future:
            future = concurrent.futures.Future()
            self._pool.submit(self._compile_into, constraint, future)
            return future
        return self.cache.get_or_start(key, tenant, start)

    def matcher(self, constraint: StructuredOutputsParams):
        """A fresh matcher for one request (waits for the compile when it is not cached).

        Raises:
            InvalidParameterError: the constraint is too large or does not compile (an
                unsupported JSON Schema feature is named), or no output can match it.
        """
        return self.submit(constraint).result().deep_copy()

    def discard(self, constraint: StructuredOutputsParams) -> None:
        """Drop ``constraint``'s compiled form, whose copies share one lexer: called when a
        request's matcher failed, so that the next request compiles it afresh."""
        self.cache.discard(constraint.key)

    @property
    def executor(self):
        """The llguidance executor that fills a step's masks in parallel."""
        if self._executor is None:
            from llguidance import LLExecutor

            self._executor = LLExecutor(num_threads=MASK_THREADS)
        return self._executor

    def _compile_into(self, constraint: StructuredOutputsParams,
                      future: concurrent.futures.Future) -> None:
        """Compile in the worker; the cache learns the entry's size before waiters wake."""
        if not future.set_running_or_notify_cancel():
            return
        try:
            self._llg_tokenizer()  # built once, not counted in the entry's bytes
            before = _rss_bytes()
            grammar = constraint.grammar_text()
            matcher = self._compile(constraint, grammar)
        except BaseException as exc:  # noqa: BLE001 - handed to the waiters
            future.set_exception(exc)
            return
        nbytes = max(_rss_bytes() - before, BYTES_PER_GRAMMAR_CHAR * len(grammar))
        self.cache.set_size(constraint.key, future, nbytes)
        future.set_result(matcher)

    def _compile(self, constraint: StructuredOutputsParams, grammar: str):
        from llguidance import LLMatcher, LLParserLimits

        label = constraint.label
        limits = LLParserLimits(initial_lexer_fuel=LEXER_FUEL, max_lexer_states=LEXER_STATES,
                                verbose_errors=False)
        try:
            matcher = LLMatcher(self._llg_tokenizer(), grammar, log_level=0, limits=limits)
        except BaseException as exc:  # a Rust panic arrives as pyo3's PanicException
            if not isinstance(exc, Exception) and type(exc).__name__ != "PanicException":
                raise
            raise InvalidParameterError(f"the {label} cannot be compiled: "
                                        f"{_reason(str(exc))}") from None
        if matcher.is_error():
            raise InvalidParameterError(f"the {label} cannot be enforced: "
                                        f"{_reason(matcher.get_error())}")
        for _ in range(2):  # the first mask builds the lexer states all copies share; the
            probe = matcher.deep_copy()  # second sees them (or the limit they ran into)
            mask = np.frombuffer(probe.compute_bitmask(), dtype=np.uint32).copy()
        error = probe.get_error() if probe.is_error() else ""
        if error.startswith(NO_TOKEN_ERROR) or (not error and _empty(probe, mask, self._eos)):
            raise InvalidParameterError(f"the {label} matches no output (its language is "
                                        "empty): no text can satisfy it")
        if error:
            raise InvalidParameterError(f"the {label} cannot be enforced: {_reason(error)}")
        return matcher

    def _llg_tokenizer(self):
        if self._lltokenizer is None:
            from llguidance.hf import from_tokenizer

            self._lltokenizer = from_tokenizer(self._tokenizer, n_vocab=self.vocab_size,
                                               eos_token=self._eos)
        return self._lltokenizer


def _empty(matcher, mask: np.ndarray, eos: list[int]) -> bool:
    """True when a fresh matcher's first mask allows no token but the end of output, while the
    empty output does not match either: its language is empty."""
    for token in eos:
        mask[token // 32] &= ~np.uint32(1 << (token % 32))
    return not mask.any() and not matcher.is_accepting()


def _rss_bytes() -> int:
    """The process's resident bytes (0 where /proc is missing)."""
    try:
        with open("/proc/self/statm", "rb") as statm:
            return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


def _reason(message: str) -> str:
    """llguidance's error in our words: its first line (caret lines and parser state dropped),
    at most 300 characters; a panic or a resource limit as what it means."""
    if message.startswith("panic") or "PanicException" in message:
        return "it is too large or complex for the grammar engine"
    if any(word in message for word in ("too big", "too many", "fuel", "limit for")):
        return "it is too large or complex for the grammar engine's limits"
    message = message.split("<state>")[0].replace("<non-verbose/>", "")
    lines = [line.strip() for line in message.splitlines()]
    return " ".join(line for line in lines if line.strip("^ "))[:300] or "invalid"
