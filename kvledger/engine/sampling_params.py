"""SamplingParams: how one request picks its tokens and when it stops.

Defaults follow the OpenAI API and vLLM (temperature 1.0, top_p 1.0, top_k disabled). A
temperature of 0 means greedy decoding. ``seed`` makes sampling reproducible per request.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvledger.errors import InvalidParameterError


@dataclass
class SamplingParams:
    """Per-request decoding parameters.

    Attributes:
        max_tokens: most new tokens to generate (>= 1); ``None`` means up to the context limit.
        temperature: softmax temperature (>= 0; 0 = greedy).
        top_p: nucleus mass in (0, 1].
        top_k: keep the k most likely tokens (0 or -1 = disabled).
        seed: seed of this request's torch.Generator (None = nondeterministic).
        stop: strings that end generation; the stop string is not included in the text.
        stop_token_ids: extra token ids that end generation (the model's EOS always does
            unless ``ignore_eos``).
        logprobs: number of top alternatives to return per token (None = no logprobs);
            the chosen token's logprob is always included when this is set.
        ignore_eos: keep generating past EOS (benchmarks use this for fixed output lengths).

    Raises:
        InvalidParameterError: on construction, when a value is out of range.
    """

    max_tokens: int | None = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    logprobs: int | None = None
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if self.max_tokens is not None and self.max_tokens <= 0:
            raise InvalidParameterError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if not 0 <= self.temperature < float("inf"):  # also refuses NaN
            raise InvalidParameterError(
                f"temperature must be a finite number >= 0, got {self.temperature}")
        if self.seed is not None and not -(2**63) <= self.seed < 2**63:
            raise InvalidParameterError(f"seed must be a 64-bit integer, got {self.seed}")
        if not 0 < self.top_p <= 1:
            raise InvalidParameterError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < -1:
            raise InvalidParameterError(f"top_k must be -1, 0 or positive, got {self.top_k}")
        if self.logprobs is not None and not 0 <= self.logprobs <= 20:
            raise InvalidParameterError(f"logprobs must be in [0, 20], got {self.logprobs}")

    @property
    def greedy(self) -> bool:
        """True when decoding is argmax (temperature 0)."""
        return self.temperature == 0
