"""What the engine hands back: one RequestOutput per request per step it progressed.

``token_ids`` and ``text`` are cumulative; ``new_token_ids`` and ``new_text`` are what this step
added (what a streaming server sends). Times are ``time.perf_counter()`` seconds.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class TokenLogprob:
    """Logprob of the chosen token and the top-k alternatives at one position; ``rank``: the
    token's rank in the distribution (1 = most likely), given for prompt tokens."""

    token_id: int
    logprob: float
    top: list[tuple[int, float]] = field(default_factory=list)
    rank: int | None = None


@dataclass
class RequestMetrics:
    """Timings (seconds, perf_counter clock) and KV figures of one request;
    ``spec_proposed_tokens`` / ``spec_accepted_tokens``: tokens its speculative verifies
    checked and accepted (``engine/spec/``)."""

    arrival_time: float = 0.0
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    cached_tokens_by_tier: dict[str, int] = field(default_factory=dict)
    tier_load_s: float = 0.0
    tier_load_predicted_s: float = 0.0
    peak_kv_bytes: int = 0
    spec_proposed_tokens: int = 0
    spec_accepted_tokens: int = 0

    @property
    def ttft_s(self) -> float | None:
        """Time to first token: arrival -> first generated token."""
        if self.first_token_time is None:
            return None
        return self.first_token_time - self.arrival_time

    @property
    def queue_time_s(self) -> float | None:
        """Arrival -> first scheduled."""
        if self.first_scheduled_time is None:
            return None
        return self.first_scheduled_time - self.arrival_time


@dataclass(frozen=True)
class CompletionOutput:
    """vLLM's per-sample view of a request's output (``RequestOutput.outputs[0]``)."""

    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None
    logprobs: list[TokenLogprob] | None


@dataclass
class RequestOutput:
    """Progress of one request after an engine step.

    ``finish_reason`` is ``"stop"`` (EOS or a stop string/token), ``"length"`` (max_tokens or
    the context limit), ``"abort"``, ``"error"`` (the scheduler refused it; ``error`` says why)
    or ``None`` while running. ``prompt_logprobs`` (when asked: ``SamplingParams.
    prompt_logprobs``) has one entry per prompt token, the first None
    (:mod:`kvledger.engine.sample.prompt_logprobs`); it is complete from the first output on.
    """

    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    new_token_ids: list[int] = field(default_factory=list)
    new_text: str = ""
    finished: bool = False
    finish_reason: str | None = None
    logprobs: list[TokenLogprob] | None = None
    prompt_logprobs: list[TokenLogprob | None] | None = None
    metrics: RequestMetrics = field(default_factory=RequestMetrics)
    error: str | None = None

    @property
    def outputs(self) -> list[CompletionOutput]:
        """The one sample as vLLM's ``outputs`` list, so ``out.outputs[0].text`` works."""
        return [CompletionOutput(0, self.text, self.token_ids, self.finish_reason,
                                 self.logprobs)]

    @property
    def tpot_s(self) -> float | None:
        """Time per output token after the first: (last - first) / (n - 1)."""
        m = self.metrics
        n = len(self.token_ids)
        if n < 2 or m.first_token_time is None or m.last_token_time is None:
            return None
        return (m.last_token_time - m.first_token_time) / (n - 1)
