"""Request bodies of the OpenAI-compatible API.

The models follow the OpenAI API reference (``/v1/completions``, ``/v1/chat/completions``) plus
the vLLM extensions ``top_k``, ``min_p``, ``repetition_penalty`` and ``ignore_eos``, vLLM's
``POST /tokenize`` and ``cache_salt`` (added to the tenant's prefix-cache salt,
:mod:`kvledger.server.auth.tenancy`), and our ``kv_policy`` (an object such as
``{"policy": "sinks", "window": 1024}``, ``ledger/retention.py``; unknown keys or bad sizes are
a 400). The sampling penalties and ``logit_bias`` are honoured by the engine's sampler (ranges:
OpenAI's, vLLM's for ``min_p`` and ``repetition_penalty``; ``logit_bias`` ids are checked
against the vocabulary when the request is added). Every field is either honoured or refused:

- fields the models do not know are ignored and logged with a warning, as vLLM does
  (:meth:`_Body.unknown_fields`); OpenAI clients send many optional ones;
- fields of the API this server does not implement (:mod:`.api_fields`: ``functions``,
  ``suffix``, ``best_of`` > 1, ``tools`` on ``/v1/completions``, ...) are accepted only at
  their neutral value (what
  the API does when they are omitted); any other value is a 400 naming the field
  (:meth:`_SamplingBody.check_supported`), as vLLM answers ``suffix``; hints with no effect on
  one server (``user``, ``prompt_cache_key``, ...) are accepted.

Structured output and tools (``response_format``, vLLM's ``structured_outputs``, ``tools``,
``tool_choice``, ``parallel_tool_calls``) are declared in
:mod:`kvledger.server.tools.structured_protocol` and planned in :mod:`kvledger.server.tools.plan`.

Defaults (README "kvledger serve"): ``/v1/completions`` ``max_tokens`` 16 (OpenAI's legacy
completions and vLLM); ``/v1/chat/completions`` up to the context limit (``None``). The engine
refuses prompt + max_tokens over the limit instead of clamping. ``max_completion_tokens`` wins
over ``max_tokens`` in chat. Only ``n = 1`` is served; a list of prompts gives one choice each.

Decoding is greedy for a temperature below 1e-5, as in vLLM (dividing logits by a tinier one
overflows), and for a ``top_p`` below 1e-6 (such a nucleus holds only the most likely token; in
fp32 it underflows to 0). Text must be valid Unicode: JSON can carry lone surrogates. Numbers
must be finite (Python's JSON parser accepts ``NaN`` and ``Infinity``).

Every error, whatever its source, leaves the server in the OpenAI shape of
:mod:`.errors`.
"""

from __future__ import annotations

from typing import Annotated, Any, ClassVar, Literal

from pydantic import (
    AfterValidator,
    ConfigDict,
    Field,
    field_validator,
    model_validator,
)

from kvledger.engine.sample.sampling_params import SamplingParams
from kvledger.server.limits.input_size import check_input_size
from kvledger.server.openai.api_fields import (
    CHAT_UNSUPPORTED,
    COMPLETIONS_UNSUPPORTED,
    HINTS,
    REASONS,
    Neutral,
    first_refused,
)
from kvledger.server.openai.errors import UnsupportedParameterError
from kvledger.server.openai.protocol_types import Text, _Part
from kvledger.server.tools.structured_protocol import (
    ChatNamedToolChoice,
    ChatTool,
    ResponseFormat,
    StructuredOutputsBody,
    ToolCallItem,
    ToolChoiceMode,
)

MAX_LOGPROBS = 20
MAX_PROMPTS = 64  # most prompts in one /v1/completions list
COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # OpenAI legacy completions and vLLM
GREEDY_BELOW = 1e-5  # vLLM's sampling epsilon: a smaller temperature decodes greedily
TOP_P_GREEDY_BELOW = 1e-6  # a nucleus this small keeps only the top token (and underflows fp32)


def _not_blank(text: str) -> str:
    """Refuse a prompt of whitespace only (the CLI's rule too: ``kvledger generate``)."""
    if not text.strip():
        raise ValueError("must contain more than whitespace")
    return text


NonNegFloat = Annotated[float, Field(ge=0)]
PositiveInt = Annotated[int, Field(ge=1)]
TokenId = Annotated[int, Field(ge=0)]
Penalty = Annotated[float, Field(ge=-2, le=2)]  # OpenAI's range of presence/frequency penalty


class _Body(_Part):
    """A request body: unknown top-level fields are kept aside to be warned about."""

    model_config = ConfigDict(extra="allow", strict=True, allow_inf_nan=False)

    @model_validator(mode="before")
    @classmethod
    def _input_size(cls, data: Any) -> Any:
        check_input_size(data)  # raises InputTooLargeError, which pydantic lets through
        return data

    def unknown_fields(self) -> list[str]:
        """Names of the body's fields that no model field declares (ignored, logged)."""
        return sorted(self.model_extra or {})


class StreamOptions(_Part):
    """``stream_options``: ``include_usage`` adds one usage chunk before ``[DONE]``;
    ``continuous_usage_stats`` (vLLM's) puts the usage so far in every chunk."""

    include_usage: bool = False
    continuous_usage_stats: bool = False


class TextPart(_Part):
    """One part of a multi-part message content; only text parts are served."""

    type: Literal["text"] = "text"
    text: Text


class ChatMessage(_Part):
    """One chat turn; list contents are joined text parts. An assistant turn may carry the
    ``tool_calls`` it made; a ``tool`` turn answers the call ``tool_call_id``."""

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Text | list[TextPart] | None = None
    tool_calls: list[ToolCallItem] | None = None
    tool_call_id: Text | None = None

    @model_validator(mode="after")
    def _tool_turn_names_its_call(self) -> ChatMessage:
        if self.role == "tool" and self.tool_call_id is None:
            raise ValueError("a 'tool' message needs 'tool_call_id', the id of the call it "
                             "answers")
        return self

    def as_template_dict(self) -> dict[str, str]:
        """The ``{"role", "content"}`` dict a Hugging Face chat template expects."""
        content = self.content
        if isinstance(content, list):
            content = "".join(part.text for part in content)
        return {"role": self.role, "content": content or ""}


class _SamplingBody(_Body):
    """Fields shared by completions and chat; turned into :class:`SamplingParams`."""

    unsupported: ClassVar[dict[str, Neutral]] = CHAT_UNSUPPORTED

    model: Text | None = None
    temperature: NonNegFloat | None = None
    top_p: Annotated[float, Field(gt=0, le=1)] | None = None
    top_k: Annotated[int, Field(ge=-1)] | None = None
    min_p: Annotated[float, Field(ge=0, le=1)] | None = None
    presence_penalty: Penalty | None = None
    frequency_penalty: Penalty | None = None
    repetition_penalty: Annotated[float, Field(gt=0)] | None = None
    logit_bias: dict[str, Annotated[float, Field(ge=-100, le=100)]] | None = None
    seed: Annotated[int, Field(ge=-(2**63), lt=2**63, description="int64")] | None = None
    stop: Text | list[Text] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: Annotated[int, Field(ge=1, le=1, description="only n = 1 is served")] = 1
    ignore_eos: bool = False
    user: Text | None = None
    kv_policy: dict[str, Any] | None = None
    cache_salt: Annotated[Text, Field(min_length=1)] | None = None

    def check_supported(self) -> None:
        """Refuse a non-neutral value of a field this server does not implement.

        Raises:
            UnsupportedParameterError: naming the first such field (HTTP 400).
        """
        given = {**(self.model_extra or {}),
                 **{n: getattr(self, n) for n in self.unsupported if n in self.model_fields_set}}
        name = first_refused(given, self.unsupported)
        if name is not None:
            raise UnsupportedParameterError(name, f"'{name}': " + REASONS.get(
                name, "not supported by this server; omit it or send its default"))

    def unknown_fields(self) -> list[str]:
        """Unknown fields, less the API's unsupported ones (refused or neutral) and hints."""
        return [name for name in super().unknown_fields()
                if name not in self.unsupported and name not in HINTS]

    def stop_strings(self) -> list[str]:
        """``stop`` as a list."""
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])

    def _logit_bias(self) -> dict[int, float] | None:
        if not self.logit_bias:
            return None
        bias = {}
        for key, value in self.logit_bias.items():
            if not (key.isascii() and key.isdigit()):  # "²" is a digit int() refuses
                raise UnsupportedParameterError(
                    "logit_bias", f"'logit_bias' keys must be token ids (digits), got {key!r}")
            bias[int(key)] = value
        return bias

    def _sampling(self, max_tokens: int | None, logprobs: int | None,
                  prompt_logprobs: int | None = None) -> SamplingParams:
        temperature = 1.0 if self.temperature is None else self.temperature
        top_p = 1.0 if self.top_p is None else self.top_p
        greedy = temperature < GREEDY_BELOW or top_p < TOP_P_GREEDY_BELOW
        return SamplingParams(
            max_tokens=max_tokens,
            temperature=0.0 if greedy else temperature,
            top_p=1.0 if greedy else top_p,
            top_k=0 if self.top_k is None else self.top_k,
            min_p=self.min_p or 0.0,
            presence_penalty=self.presence_penalty or 0.0,
            frequency_penalty=self.frequency_penalty or 0.0,
            repetition_penalty=1.0 if self.repetition_penalty is None else self.repetition_penalty,
            logit_bias=self._logit_bias(),
            seed=self.seed,
            stop=self.stop_strings(),
            logprobs=logprobs,
            prompt_logprobs=prompt_logprobs,
            ignore_eos=self.ignore_eos,
            kv_policy=self.kv_policy,
        )

    @property
    def include_usage(self) -> bool:
        """True when a streamed response must end with one usage chunk."""
        return bool(self.stream_options and self.stream_options.include_usage)

    @property
    def continuous_usage(self) -> bool:
        """True when every stream chunk carries the usage so far."""
        return bool(self.stream_options and self.stream_options.continuous_usage_stats)


# How validation errors of the union-typed fields are worded (server.validation.describe).
UNION_RULES = {
    "prompt": f"must be a string with more than whitespace, a non-empty list of token ids "
              f"(integers >= 0), or a list of 1 to {MAX_PROMPTS} of either",
    "stop": "must be a string or a list of strings (valid Unicode)",
    "content": "must be a string (valid Unicode), a list of text parts, or null",
}

NonEmptyText = Annotated[Text, Field(min_length=1), AfterValidator(_not_blank)]
TokenIds = Annotated[list[TokenId], Field(min_length=1)]


def _no_streamed_prompt_logprobs(body):
    """``body``, unless it asks for ``prompt_logprobs`` with ``stream`` (as vLLM, refused)."""
    if body.stream and body.prompt_logprobs is not None:
        raise ValueError("'prompt_logprobs' with 'stream' is not supported: send stream false")
    return body


class CompletionRequest(_SamplingBody):
    """``POST /v1/completions``: a text prompt, token ids, or a list of either (one choice
    per prompt).

    ``echo`` puts the prompt before the completion, in the text and, with ``logprobs``, in the
    logprobs (the first prompt token's logprob is null); ``max_tokens: 0`` with ``echo``
    returns the prompt alone (the engine still runs one step, whose token is dropped, as in
    vLLM). ``prompt_logprobs`` (vLLM's) adds each prompt token's logprob and top alternatives
    as ``choices[i].prompt_logprobs``; ``echo`` with ``logprobs`` N computes them with N.
    Neither is streamed (400).
    """

    unsupported: ClassVar[dict[str, Neutral]] = COMPLETIONS_UNSUPPORTED

    prompt: (NonEmptyText | TokenIds
             | Annotated[list[NonEmptyText], Field(min_length=1, max_length=MAX_PROMPTS)]
             | Annotated[list[TokenIds], Field(min_length=1, max_length=MAX_PROMPTS)])
    max_tokens: Annotated[int, Field(ge=0)] | None = COMPLETIONS_DEFAULT_MAX_TOKENS
    logprobs: Annotated[int, Field(ge=0, le=MAX_LOGPROBS)] | None = None
    echo: bool = False
    prompt_logprobs: Annotated[int, Field(ge=0, le=MAX_LOGPROBS)] | None = None
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsBody | None = None

    @model_validator(mode="after")
    def _echo_rules(self) -> CompletionRequest:
        if self.max_tokens == 0 and not self.echo:
            raise ValueError("'max_tokens' must be >= 1 unless 'echo' is true (then 0 returns "
                             "the prompt alone)")
        if self.stream and self.echo:
            raise ValueError("'echo' with 'stream' is not supported: send stream false")
        return _no_streamed_prompt_logprobs(self)

    @property
    def prompt_only(self) -> bool:
        """True for ``echo`` with ``max_tokens: 0``: the answer is the prompt alone."""
        return self.max_tokens == 0

    def prompts(self) -> list[str | list[int]]:
        """The prompts, one per choice: a text, or a list of token ids."""
        prompt = self.prompt
        if isinstance(prompt, str) or isinstance(prompt[0], int):
            return [prompt]
        return list(prompt)

    def sampling_params(self) -> SamplingParams:
        """SamplingParams of this request (raises InvalidParameterError on bad values)."""
        prompt_logprobs = self.prompt_logprobs
        if prompt_logprobs is None and self.echo:
            prompt_logprobs = self.logprobs
        return self._sampling(1 if self.prompt_only else self.max_tokens, self.logprobs,
                              prompt_logprobs)


class ChatCompletionRequest(_SamplingBody):
    """``POST /v1/chat/completions``: messages rendered by the model's chat template.

    ``prompt_logprobs`` (vLLM's) adds each token's logprob and top alternatives of the
    rendered prompt as the response's top-level ``prompt_logprobs``, as vLLM does; not
    streamed (400).
    """

    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_tokens: PositiveInt | None = None
    max_completion_tokens: PositiveInt | None = None
    logprobs: bool = False
    top_logprobs: Annotated[int, Field(ge=0, le=MAX_LOGPROBS)] | None = None
    prompt_logprobs: Annotated[int, Field(ge=0, le=MAX_LOGPROBS)] | None = None
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsBody | None = None
    tools: list[ChatTool] | None = None
    tool_choice: ToolChoiceMode | ChatNamedToolChoice | None = None
    parallel_tool_calls: bool = True

    @model_validator(mode="after")
    def _top_logprobs_needs_logprobs(self) -> ChatCompletionRequest:
        if self.top_logprobs and not self.logprobs:
            raise ValueError("'top_logprobs' requires 'logprobs' to be true")
        return _no_streamed_prompt_logprobs(self)

    @field_validator("messages")
    @classmethod
    def _tool_turns_answer_earlier_calls(cls, messages: list[ChatMessage]) -> list[ChatMessage]:
        called: set[str] = set()
        for i, m in enumerate(messages):
            called.update(call.id for call in m.tool_calls or ())
            if m.role == "tool" and m.tool_call_id not in called:
                raise ValueError(
                    f"messages[{i}] answers tool_call_id {m.tool_call_id!r}, which no earlier "
                    "assistant message's 'tool_calls' made (OpenAI's rule)")
        return messages

    def template_messages(self) -> list[dict[str, str]]:
        """Messages as chat-template dicts."""
        return [m.as_template_dict() for m in self.messages]

    def prompts(self) -> list[list[dict[str, str]]]:
        """The one prompt of a chat request: its messages."""
        return [self.template_messages()]

    def sampling_params(self) -> SamplingParams:
        """SamplingParams of this request (raises InvalidParameterError on bad values)."""
        max_tokens = self.max_completion_tokens or self.max_tokens
        logprobs = (self.top_logprobs or 0) if self.logprobs else None
        return self._sampling(max_tokens, logprobs, self.prompt_logprobs)


class TokenizeRequest(_Body):
    """``POST /tokenize``: exactly one of ``prompt`` (text) or ``messages`` (chat)."""

    model: Text | None = None
    prompt: NonEmptyText | None = None
    messages: Annotated[list[ChatMessage], Field(min_length=1)] | None = None
    add_special_tokens: bool = True  # vLLM's: a text prompt gets the tokenizer's BOS etc.

    @model_validator(mode="after")
    def _exactly_one_input(self) -> TokenizeRequest:
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give exactly one of 'prompt' or 'messages'")
        return self

    def engine_input(self) -> str | list[dict[str, str]]:
        """What ``LLMEngine.tokenize`` takes: the text or the chat-template dicts."""
        if self.messages is not None:
            return [m.as_template_dict() for m in self.messages]
        return self.prompt


class DetokenizeRequest(_Body):
    """``POST /detokenize`` (vLLM's): token ids of the served model."""

    model: Text | None = None
    tokens: TokenIds
