"""SamplingParams: how one request picks its tokens and when it stops.

Defaults follow the OpenAI API and vLLM (temperature 1.0, top_p 1.0, top_k disabled, no
penalties). A temperature of 0 means greedy decoding. ``seed`` makes sampling reproducible per
request. Every field is checked on construction, types included (``max_tokens=3.5`` or
``True``, ``temperature="0.5"``, ``stop=5`` or ``[""]`` are refused), so a bad value fails
where it is written, before any engine state is touched. Ranges are OpenAI's, and vLLM's where
OpenAI has none (``min_p`` in [0, 1], ``repetition_penalty`` > 0).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from numbers import Real

from kvledger.engine.sample.structured.constraint import StructuredOutputsParams
from kvledger.errors import InvalidParameterError
from kvledger.ledger.retention import RetentionSpec

MAX_LOGPROBS = 20
MAX_LOGIT_BIAS = 100.0  # OpenAI: logit_bias values in [-100, 100]
MAX_PENALTY = 2.0  # OpenAI: presence / frequency penalty in [-2, 2]


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value) -> bool:
    return isinstance(value, Real) and not isinstance(value, bool)


def _number(name: str, value, lo: float, hi: float, lo_open: bool = False) -> float:
    """``value`` as a float within [lo, hi] ((lo, hi] when ``lo_open``); NaN is refused."""
    if not _is_number(value):
        raise InvalidParameterError(f"{name} must be a number, got {value!r}")
    value = float(value)
    low_ok = value > lo if lo_open else value >= lo
    if not (low_ok and value <= hi):  # NaN fails both
        interval = f"{'(' if lo_open else '['}{lo:g}, {hi:g}]"
        raise InvalidParameterError(f"{name} must be in {interval}, got {value!r}")
    return value


@dataclass
class SamplingParams:
    """Per-request decoding parameters.

    Attributes:
        max_tokens: most new tokens to generate (int >= 1); ``None`` means up to the context
            limit.
        temperature: softmax temperature (>= 0, finite; 0 = greedy).
        top_p: nucleus mass in (0, 1].
        top_k: keep the k most likely tokens (0 or -1 = disabled).
        min_p: drop tokens less likely than ``min_p`` x the most likely one ([0, 1]; 0 = off).
        presence_penalty: subtracted from the logit of every token already generated
            ([-2, 2]).
        frequency_penalty: subtracted once per earlier occurrence in the output ([-2, 2]).
        repetition_penalty: divides positive / multiplies negative logits of tokens seen in the
            prompt or output (> 0; 1 = off).
        logit_bias: token id -> value in [-100, 100] added to its logit (ids checked against
            the vocabulary when the request is added).
        seed: seed of this request's torch.Generator (None = nondeterministic).
        stop: strings that end generation (a string or a list of non-empty strings); the stop
            string is not included in the text.
        stop_token_ids: extra token ids that end generation (the model's EOS always does
            unless ``ignore_eos``).
        logprobs: number of top alternatives to return per token (None = no logprobs);
            the chosen token's logprob is always included when this is set.
        prompt_logprobs: the same for every prompt token (vLLM's; None = none); such a
            request reads no prefix-cache hit (``engine/sample/prompt_logprobs.py``).
        ignore_eos: keep generating past EOS (benchmarks use this for fixed output lengths).
        kv_policy: this request's KV retention policy: a ``RetentionSpec``, an object
            ``{"policy": "sinks", "window": 1024, ...}`` or a policy name; None = the engine's
            ``--kv-policy`` (``ledger/retention.py``).
        structured_outputs: the constraint the output must match (a JSON schema, any JSON
            object, a regex, a choice of strings or a grammar): a ``StructuredOutputsParams``
            or a dict of its fields (``engine/sample/structured/constraint.py``); None = free text.

    Raises:
        InvalidParameterError: on construction, when a value has the wrong type or range.
    """

    max_tokens: int | None = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] | None = None
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    ignore_eos: bool = False
    kv_policy: RetentionSpec | dict | str | None = None
    structured_outputs: StructuredOutputsParams | dict | None = None

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """Check (and normalise) every field; run again by the engine on each request, so a
        field changed after construction is checked too.

        Raises:
            InvalidParameterError: a value has the wrong type or range.
        """
        if self.max_tokens is not None and (not _is_int(self.max_tokens) or self.max_tokens < 1):
            raise InvalidParameterError(
                f"max_tokens must be an integer >= 1 or None, got {self.max_tokens!r}")
        self.temperature = _number("temperature", self.temperature, 0.0, math.inf)
        if math.isinf(self.temperature):
            raise InvalidParameterError("temperature must be a finite number >= 0, got inf")
        self.top_p = _number("top_p", self.top_p, 0.0, 1.0, lo_open=True)
        if not _is_int(self.top_k) or self.top_k < -1:
            raise InvalidParameterError(
                f"top_k must be -1, 0 or a positive integer, got {self.top_k!r}")
        self.min_p = _number("min_p", self.min_p, 0.0, 1.0)
        self.presence_penalty = _number("presence_penalty", self.presence_penalty,
                                        -MAX_PENALTY, MAX_PENALTY)
        self.frequency_penalty = _number("frequency_penalty", self.frequency_penalty,
                                         -MAX_PENALTY, MAX_PENALTY)
        self.repetition_penalty = _number("repetition_penalty", self.repetition_penalty,
                                          0.0, math.inf, lo_open=True)
        if math.isinf(self.repetition_penalty):
            raise InvalidParameterError("repetition_penalty must be finite, got inf")
        self._check_logit_bias()
        if self.seed is not None and (not _is_int(self.seed)
                                      or not -(2**63) <= self.seed < 2**63):
            raise InvalidParameterError(f"seed must be a 64-bit integer, got {self.seed!r}")
        self._check_stop()
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and (not _is_int(value) or not 0 <= value <= MAX_LOGPROBS):
                raise InvalidParameterError(
                    f"{name} must be an integer in [0, {MAX_LOGPROBS}], got {value!r}")
        if not isinstance(self.ignore_eos, bool):
            raise InvalidParameterError(f"ignore_eos must be true or false, got "
                                        f"{self.ignore_eos!r}")
        if isinstance(self.kv_policy, str):
            self.kv_policy = RetentionSpec(self.kv_policy)
        elif self.kv_policy is not None:
            self.kv_policy = RetentionSpec.from_dict(self.kv_policy)
        if self.structured_outputs is not None:
            self.structured_outputs = StructuredOutputsParams.from_value(self.structured_outputs)

    def _check_stop(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if not isinstance(self.stop, list | tuple) or not all(
                isinstance(s, str) and s for s in self.stop):
            raise InvalidParameterError(
                f"stop must be a string or a list of non-empty strings, got {self.stop!r}")
        self.stop = list(self.stop)
        if not isinstance(self.stop_token_ids, list | tuple) or not all(
                _is_int(t) and t >= 0 for t in self.stop_token_ids):
            raise InvalidParameterError(
                f"stop_token_ids must be a list of token ids >= 0, got {self.stop_token_ids!r}")
        self.stop_token_ids = list(self.stop_token_ids)

    def _check_logit_bias(self) -> None:
        if self.logit_bias is None:
            return
        if not isinstance(self.logit_bias, dict):
            raise InvalidParameterError(
                f"logit_bias must be a dict of token id -> bias, got {self.logit_bias!r}")
        checked = {}
        for token, bias in self.logit_bias.items():
            if not _is_int(token) or token < 0:
                raise InvalidParameterError(
                    f"logit_bias keys must be token ids (integers >= 0), got {token!r}")
            checked[token] = _number(f"logit_bias[{token}]", bias, -MAX_LOGIT_BIAS,
                                     MAX_LOGIT_BIAS)
        self.logit_bias = checked

    @property
    def greedy(self) -> bool:
        """True when decoding is argmax (temperature 0)."""
        return self.temperature == 0

    def check_vocab(self, vocab_size: int) -> None:
        """Refuse token ids at or past ``vocab_size`` in ``logit_bias`` / ``stop_token_ids``.

        Raises:
            InvalidParameterError: naming the first such id.
        """
        for name, ids in (("logit_bias", self.logit_bias or {}),
                          ("stop_token_ids", self.stop_token_ids)):
            bad = [t for t in ids if t >= vocab_size]
            if bad:
                raise InvalidParameterError(
                    f"{name} has token id {bad[0]}, outside the vocabulary (0..{vocab_size - 1})")
