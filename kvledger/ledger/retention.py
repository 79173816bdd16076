"""KV retention policies as numbers: which policy, its sizes, and the KV it can ever hold.

A retention policy decides which tokens' K/V a sequence keeps (seed §4.4):

- ``full``: every token (the default).
- ``window``: the ``window`` most recent tokens (the query itself included).
- ``sinks``: the first ``sinks`` tokens plus the ``window`` most recent (StreamingLLM, Xiao et
  al., arXiv:2309.17453).
- ``h2o``: at most ``budget`` tokens: ``sinks`` first tokens, the ``window`` most recent, and
  the rest by highest attention accumulated over the queries so far (heavy hitters; Zhang et
  al., arXiv:2306.14048).
- ``snapkv``: once, when the prompt has been prefilled, keep ``budget`` prompt tokens: the last
  ``snapkv_window`` (the observation window) and the others with the highest attention from
  those queries, average-pooled over ``snapkv_kernel`` neighbouring positions (Li et al.,
  arXiv:2404.14469); then decode keeping everything.

h2o and snapkv choose ``per-head`` (each layer and KV head its own tokens, by the attention of
that KV head's query heads) or ``per-sequence`` (one choice for all, by attention summed over
layers and heads): ``select``. Either way every head keeps the same number of tokens, so the
sizes and bounds below hold for both.

*Capacity* is the most keys one query attends: ``sinks + window`` for window/sinks,
``budget`` for h2o. A sequence holds at most ``capacity - 1`` tokens between steps (the next
query adds itself), plus the tokens of the chunk being computed. Positions ``p`` with
``p < first_affected`` attend exactly what ``full`` attends, so their K/V equal full's: only
blocks before that may enter the prefix cache.

Positions (``positions``, window/sinks only): ``original`` keeps every kept key at the position
it was computed at (kvpress's default), so past the model's trained context the query's distance
to the sinks grows without bound; ``cache`` attends as if the held tokens sat at positions
``0..n-1`` in slot order and the query at ``n`` (StreamingLLM's scheme), so no distance ever
exceeds the capacity. How the engine does it: ``engine/retention/state.py``.

Scope (``scope``, window/sinks/h2o): ``always`` applies the policy at every step, so the
sequence's KV stays bounded; ``prompt`` applies it once, when the prompt has been prefilled
(with full attention), and then keeps every later token, as kvpress's presses do and as snapkv
always does: the prompt keeps ``sinks + window`` tokens (window/sinks) or ``budget`` (h2o:
sinks, the prompt's last ``window`` tokens and the heavy hitters by the attention of every
prompt query), and the KV grows with the output. snapkv always compresses the prompt only.

Pure integers, no torch; the engine's policy classes (``kvledger/engine/retention``) and the
admission rule (``ledger/admission.py``) read their sizes and bounds from here.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, fields

from kvledger.errors import InvalidParameterError

POLICIES = ("full", "window", "sinks", "h2o", "snapkv")
DEFAULT_SINKS = 4
SNAPKV_WINDOW = 32
SNAPKV_KERNEL = 7
POSITIONS = ("original", "cache")
DEFAULT_POSITIONS = "cache"
"""Positions of window/sinks when none is named (chosen by measurement: BENCHMARKS.md)."""
SCOPES = ("always", "prompt")
DEFAULT_SCOPE = "always"
"""Scope of window/sinks/h2o when none is named: the budget holds at every step."""
SCOPED = ("window", "sinks", "h2o")
"""Policies that take a scope (snapkv compresses the prompt only; full drops nothing)."""
H2O_SCORES = ("sum", "mean")
"""h2o's key scores: ``sum`` of the attention received (H2O's accumulation, the default) or
``mean`` per query that saw the key (kvpress's ObservedAttentionPress)."""
SELECTIONS = ("per-head", "per-sequence")
DEFAULT_SELECT = "per-head"
"""h2o/snapkv's default token selection (measured: BENCHMARKS.md, "Per-KV-head vs per-sequence selection")."""
EVICTION_CHUNK = 64
"""Most tokens of an evicting sequence computed in one step (eviction runs between steps)."""


MAX_TOKENS = (1 << 31) - 1
"""The largest token count a retention option takes (any context fits; no 2^70 windows)."""


def _check_int(name: str, value, low: int) -> None:
    if value is not None and (not isinstance(value, int) or isinstance(value, bool)
                              or not low <= value <= MAX_TOKENS):
        relation = "> 0" if low == 1 else f">= {low}"
        raise InvalidParameterError(f"kv_{name} must be an integer {relation} and < 2^31, got "
                                    f"{value!r}")


@dataclass(frozen=True)
class RetentionSpec:
    """One retention policy with its sizes (all in tokens).

    Attributes:
        policy: one of :data:`POLICIES`.
        window: recent tokens kept (window, sinks; h2o's recent part, default budget // 2).
        sinks: first tokens always kept (sinks, h2o; default 4; 0 for window).
        budget: most tokens kept (h2o, snapkv).
        snapkv_window: snapkv's observation window (last prompt queries), default 32.
        snapkv_kernel: snapkv's pooling kernel, odd, default 7.
        positions: ``original`` or ``cache`` (window, sinks; default
            :data:`DEFAULT_POSITIONS`); every other policy keeps original positions.
        select: how h2o/snapkv choose tokens (None for the other policies): ``per-head``
            (default) lets each (layer, KV head) keep its own top tokens by its own scores
            (the query heads of a GQA group pooled: kvpress's and SnapKV's shape);
            ``per-sequence`` keeps one set of tokens for all layers and heads, by scores
            summed over them. Both keep the same number of tokens.
        h2o_scores: how h2o ranks keys (None for the other policies): ``sum`` (default) of the
            attention each received, or ``mean``: that sum divided by the number of scored
            queries that saw the key (kvpress's ObservedAttentionPress).
        scope: when window/sinks/h2o drop tokens (None for full and snapkv): ``always``
            (default, every step: the KV stays bounded) or ``prompt`` (once, when the prompt
            is prefilled, then every later token is kept: kvpress's shape).

    Raises:
        InvalidParameterError: unknown policy, window <= 0, negative sinks, a size the policy
            does not take, a missing size, an h2o budget below sinks + window + 1 (the sinks
            and window would fill the cache), a snapkv budget not above its window, unknown
            positions, ``cache`` positions for a policy other than window/sinks, an unknown
            scope, a scope for full or snapkv, ``cache`` positions with scope ``prompt``, an
            unknown ``h2o_scores`` or one for a policy other than h2o.
    """

    policy: str = "full"
    window: int | None = None
    sinks: int | None = None
    budget: int | None = None
    snapkv_window: int = SNAPKV_WINDOW
    snapkv_kernel: int = SNAPKV_KERNEL
    positions: str | None = None
    select: str | None = None
    scope: str | None = None
    h2o_scores: str | None = None

    def __post_init__(self) -> None:
        if self.policy not in POLICIES:
            raise InvalidParameterError(
                f"kv_policy must be one of {', '.join(POLICIES)}, got {self.policy!r}")
        _check_int("window", self.window, 1)
        _check_int("sinks", self.sinks, 0)
        _check_int("budget", self.budget, 1)
        _check_int("snapkv_window", self.snapkv_window, 1)
        _check_int("snapkv_kernel", self.snapkv_kernel, 1)
        takes = {"full": (), "window": ("window",), "sinks": ("window", "sinks"),
                 "h2o": ("window", "sinks", "budget"), "snapkv": ("budget",)}[self.policy]
        for name in ("window", "sinks", "budget"):
            resolved = name == "sinks" and self.sinks == 0  # what as_dict gives back
            if getattr(self, name) is not None and name not in takes and not resolved:
                raise InvalidParameterError(
                    f"kv_policy {self.policy!r} takes no kv_{name}"
                    + (f" (it takes {', '.join('kv_' + t for t in takes)})" if takes else ""))
        if self.policy in ("window", "sinks") and self.window is None:
            raise InvalidParameterError(f"kv_policy {self.policy!r} needs kv_window")
        if self.policy in ("h2o", "snapkv") and self.budget is None:
            raise InvalidParameterError(f"kv_policy {self.policy!r} needs kv_budget")
        self._resolve_scope()
        self._resolve_positions()
        default_sinks = DEFAULT_SINKS if self.policy in ("sinks", "h2o") else 0
        object.__setattr__(self, "sinks", default_sinks if self.sinks is None else self.sinks)
        if self.policy in ("h2o", "snapkv"):
            select = DEFAULT_SELECT if self.select is None else self.select
            if select not in SELECTIONS:
                raise InvalidParameterError(f"kv_select must be one of {', '.join(SELECTIONS)}"
                                            f", got {select!r}")
            object.__setattr__(self, "select", select)
        elif self.select is not None:
            raise InvalidParameterError(
                f"kv_policy {self.policy!r} takes no kv_select (only h2o and snapkv select "
                f"tokens by attention)")
        self._resolve_h2o_scores()
        if self.policy == "h2o":
            if self.window is None:
                object.__setattr__(self, "window", max(1, self.budget // 2))
            if self.budget < self.sinks + self.window + 1:
                raise InvalidParameterError(
                    f"kv_budget {self.budget} leaves no room for heavy hitters: it must be >= "
                    f"kv_sinks + kv_window + 1 = {self.sinks + self.window + 1}")
        if self.policy == "snapkv":
            if self.snapkv_kernel % 2 == 0:
                raise InvalidParameterError(
                    f"snapkv_kernel must be odd, got {self.snapkv_kernel}")
            if self.budget <= self.snapkv_window:
                raise InvalidParameterError(
                    f"snapkv kv_budget {self.budget} must be above its observation window of "
                    f"{self.snapkv_window} tokens")

    def _resolve_h2o_scores(self) -> None:
        if self.policy != "h2o":
            if self.h2o_scores is not None:
                raise InvalidParameterError(f"kv_policy {self.policy!r} takes no h2o_scores")
            return
        if self.h2o_scores not in (None, *H2O_SCORES):
            raise InvalidParameterError(f"h2o_scores must be one of {', '.join(H2O_SCORES)}, "
                                        f"got {self.h2o_scores!r}")
        object.__setattr__(self, "h2o_scores", self.h2o_scores or "sum")

    def _resolve_scope(self) -> None:
        if self.scope is not None and self.scope not in SCOPES:
            raise InvalidParameterError(
                f"kv_scope must be one of {', '.join(SCOPES)}, got {self.scope!r}")
        if self.policy in SCOPED:
            object.__setattr__(self, "scope", self.scope or DEFAULT_SCOPE)
        elif self.scope is not None:
            what = ("compresses the prompt only" if self.policy == "snapkv"
                    else "drops no token")
            raise InvalidParameterError(
                f"kv_scope applies to {', '.join(SCOPED)}, not {self.policy!r} (it {what})")
        if self.scope == "prompt" and self.positions == "cache":
            raise InvalidParameterError(
                "kv_positions 'cache' needs kv_scope 'always' (a prompt compressed once keeps "
                "original positions)")

    def _resolve_positions(self) -> None:
        if self.positions is not None and self.positions not in POSITIONS:
            raise InvalidParameterError(
                f"kv_positions must be one of {', '.join(POSITIONS)}, got {self.positions!r}")
        if self.policy in ("window", "sinks"):
            default = "original" if self.scope == "prompt" else DEFAULT_POSITIONS
            object.__setattr__(self, "positions", self.positions or default)
        elif self.positions == "cache":
            raise InvalidParameterError(
                f"kv_positions 'cache' applies to window and sinks, not {self.policy!r} "
                f"(it keeps original positions)")
        else:
            object.__setattr__(self, "positions", "original")

    @classmethod
    def from_dict(cls, obj) -> RetentionSpec:
        """A spec from a JSON-like object ``{"policy": "sinks", "window": 1024, ...}``.

        Raises:
            InvalidParameterError: not an object, an unknown key, or a bad value.
        """
        if isinstance(obj, RetentionSpec):
            return obj
        if not isinstance(obj, dict):
            raise InvalidParameterError(f"kv_policy must be an object, got {obj!r}")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(obj) - known)
        if unknown:
            raise InvalidParameterError(
                f"kv_policy has unknown key(s) {', '.join(map(repr, unknown))} "
                f"(known: {', '.join(sorted(known))})")
        return cls(**obj)

    def as_dict(self) -> dict:
        """The fields as a plain dict (JSON-able)."""
        return asdict(self)

    @property
    def evicts(self) -> bool:
        """True for every policy that drops tokens while a sequence runs (not full)."""
        return self.policy != "full"

    @property
    def compresses_prompt(self) -> bool:
        """True when the policy drops tokens once, after the prompt, and then keeps every
        token: snapkv, and window/sinks/h2o in scope ``prompt``."""
        return self.policy == "snapkv" or self.scope == "prompt"

    @property
    def prompt_keep(self) -> int | None:
        """Prompt tokens kept when the prompt is compressed (all when it is shorter): budget
        (snapkv, h2o) or sinks + window (window, sinks); None when no prompt is compressed."""
        if not self.compresses_prompt:
            return None
        return self.budget if self.policy in ("h2o", "snapkv") else self.sinks + self.window

    @property
    def capacity(self) -> int | None:
        """Most keys one query attends (itself included); None when unbounded (full, and the
        policies that compress the prompt only and decode keeping everything)."""
        if self.compresses_prompt:
            return None
        if self.policy in ("window", "sinks"):
            return self.sinks + self.window
        if self.policy == "h2o":
            return self.budget
        return None

    @property
    def first_affected(self) -> int | None:
        """First position whose attention may differ from full's; None for full.

        Tokens before it have exactly full's K/V (window/sinks: sinks + window; h2o: budget;
        a compressed prompt: its kept count, since a prompt no longer than that loses nothing;
        the prompt itself is prefilled in full: see :meth:`shareable_tokens`).
        """
        if self.policy == "full":
            return None
        if self.compresses_prompt:
            return self.prompt_keep
        return self.capacity

    def shareable_tokens(self, num_prompt_tokens: int) -> int | None:
        """Leading tokens whose K/V equal full's and may be hashed / hit in the prefix cache
        (None = all). A policy that compresses the prompt prefills it with full attention."""
        if self.compresses_prompt:
            return num_prompt_tokens
        return self.first_affected

    def cache_hit_tokens(self, num_prompt_tokens: int) -> int | None:
        """Leading prompt tokens a request may take from the prefix cache (None = all): its
        shareable tokens, but none for h2o in scope ``prompt``, whose heavy hitters are
        scored by the attention of every prompt query (a hit token's query is never run)."""
        if self.policy == "h2o" and self.scope == "prompt":
            return 0
        return self.shareable_tokens(num_prompt_tokens)

    def max_kv_tokens(self, num_prompt_tokens: int, total_tokens: int,
                      chunk_tokens: int = EVICTION_CHUNK) -> int:
        """Most K/V slots a request of ``total_tokens`` (prompt + output) ever holds at once.

        Full: ``total - 1`` (the last sampled token is never fed back). Window/sinks/h2o:
        ``capacity - 1`` kept between steps plus one chunk of ``chunk_tokens`` being computed.
        A compressed prompt (snapkv, scope ``prompt``): the whole prompt until it is
        compressed, then :attr:`prompt_keep` plus the output. Never more than full's figure.
        """
        full = max(total_tokens - 1, 0)
        if self.capacity is not None:
            return min(full, self.capacity - 1 + chunk_tokens)
        if self.compresses_prompt:
            output = total_tokens - num_prompt_tokens
            return min(full, max(num_prompt_tokens, min(self.prompt_keep, num_prompt_tokens)
                                 + output - 1))
        return full

    def max_kv_blocks(self, num_prompt_tokens: int, total_tokens: int, block_size: int,
                      chunk_tokens: int = EVICTION_CHUNK) -> int:
        """Most blocks of ``block_size`` tokens such a request ever holds.

        A block goes back to the pool only when none of its tokens is kept, and token-level
        policies (h2o, snapkv) compact what they keep once a block's worth of holes has
        gathered, so besides ``ceil(max_kv_tokens / block_size)`` a sequence may hold: one
        block split between the sinks and the dropped tokens, one partly dropped at the start
        of the window, and (h2o, snapkv) one block's worth of holes not yet compacted (the
        same for a prompt compressed in scope ``prompt``).
        """
        full = math.ceil(max(total_tokens - 1, 0) / block_size)
        tokens = self.max_kv_tokens(num_prompt_tokens, total_tokens, chunk_tokens)
        if not self.evicts or tokens == max(total_tokens - 1, 0) and not self.compresses_prompt:
            return full
        extra = 2 if self.policy in ("window", "sinks") else 3
        return min(full, math.ceil(tokens / block_size) + extra)

    def describe(self) -> str:
        """One line, e.g. ``sinks (4 sinks + 1024 recent)``."""
        if self.policy == "full":
            return "full (every token kept)"
        at = f" at {self.positions} positions"
        once = ", prompt only, then every token" if self.scope == "prompt" else ""
        if self.policy == "window":
            return f"window ({self.window} recent{once}){at}"
        if self.policy == "sinks":
            return f"sinks ({self.sinks} sinks + {self.window} recent{once}){at}"
        if self.policy == "h2o":
            return (f"h2o (budget {self.budget}: {self.sinks} sinks + {self.window} recent + "
                    f"{self.budget - self.sinks - self.window} heavy hitters, {self.select}"
                    f"{', mean scores' if self.h2o_scores == 'mean' else ''}{once})")
        return (f"snapkv (prompt compressed to {self.budget}, observation window "
                f"{self.snapkv_window}, pooling {self.snapkv_kernel}, {self.select})")


def spec_from_options(policy: str | None, window: int | None, sinks: int | None,
                      budget: int | None, positions: str | None = None,
                      select: str | None = None, scope: str | None = None) -> RetentionSpec:
    """The spec of the command-line options ``--kv-policy/--kv-window/--kv-sinks/--kv-budget/
    --kv-positions/--kv-select/--kv-scope`` (policy None = full; sizes given without a policy
    are an error)."""
    if policy is None:
        given = [n for n, v in (("window", window), ("sinks", sinks), ("budget", budget),
                                ("positions", positions), ("select", select),
                                ("scope", scope)) if v is not None]
        if given:
            raise InvalidParameterError(
                f"kv_{given[0]} needs kv_policy (window, sinks, h2o or snapkv)")
        return RetentionSpec()
    return RetentionSpec(policy, window=window, sinks=sinks, budget=budget, positions=positions,
                         select=select, scope=scope)
