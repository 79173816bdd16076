"""Request bodies of the OpenAI-compatible API, and the OpenAI error shape.

The models follow the OpenAI API reference (``/v1/completions``, ``/v1/chat/completions``) plus
the vLLM extensions ``top_k`` and ``ignore_eos`` (the bench tool sends ``ignore_eos``) and vLLM's
``POST /tokenize``. Unknown fields are ignored, as OpenAI clients send many optional ones. Only
``n = 1`` is served. An omitted ``max_tokens`` means "up to the context limit" (``None``) on both
endpoints, as issue 5 specifies (OpenAI's legacy completions default is 16); the engine refuses
prompt + max_tokens over the limit instead of clamping. ``max_completion_tokens`` wins over
``max_tokens`` in chat.

Decoding is greedy for a temperature below 1e-5, as in vLLM (dividing logits by a tinier one
overflows), and for a ``top_p`` below 1e-6 (such a nucleus holds only the most likely token; in
fp32 it underflows to 0). Text must be valid Unicode: JSON can carry lone surrogates.

Every error, whatever its source, leaves the server as
``{"error": {"message", "type", "param", "code"}}`` (:func:`error_body`).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, model_validator

from kvledger.engine.sampling_params import SamplingParams

MAX_LOGPROBS = 20
GREEDY_BELOW = 1e-5  # vLLM's sampling epsilon: a smaller temperature decodes greedily
TOP_P_GREEDY_BELOW = 1e-6  # a nucleus this small keeps only the top token (and underflows fp32)


def _utf8(text: str) -> str:
    """Refuse lone surrogates: no tokenizer takes them and no UTF-8 reply can echo them."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise ValueError("text must be valid Unicode (no lone surrogates)") from None
    return text


Text = Annotated[str, AfterValidator(_utf8)]

NonNegFloat = Annotated[float, Field(ge=0)]
PositiveInt = Annotated[int, Field(ge=1)]
TokenId = Annotated[int, Field(ge=0)]


def error_body(message: str, err_type: str, param: str | None = None, code: Any = None) -> dict:
    """The OpenAI error object: ``{"error": {"message", "type", "param", "code"}}``."""
    return {"error": {"message": message, "type": err_type, "param": param, "code": code}}


class ErrorDetail(BaseModel):
    """The inside of an OpenAI error."""

    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    """OpenAPI schema of every 4xx answer (see :func:`error_body`)."""

    error: ErrorDetail


class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)  # no "yes" for true, no true for 1


class StreamOptions(_Body):
    """``stream_options``: ``include_usage`` adds one usage chunk before ``[DONE]``."""

    include_usage: bool = False


class TextPart(_Body):
    """One part of a multi-part message content; only text parts are served."""

    type: Literal["text"] = "text"
    text: Text


class ChatMessage(_Body):
    """One chat turn; list contents are joined text parts."""

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Text | list[TextPart] | None = None

    def as_template_dict(self) -> dict[str, str]:
        """The ``{"role", "content"}`` dict a Hugging Face chat template expects."""
        content = self.content
        if isinstance(content, list):
            content = "".join(part.text for part in content)
        return {"role": self.role, "content": content or ""}


class _SamplingBody(_Body):
    """Fields shared by completions and chat; turned into :class:`SamplingParams`."""

    model: Text | None = None
    temperature: NonNegFloat | None = None
    top_p: Annotated[float, Field(gt=0, le=1)] | None = None
    top_k: Annotated[int, Field(ge=-1)] | None = None
    seed: Annotated[int, Field(ge=-(2**63), lt=2**63, description="int64")] | None = None
    stop: Text | list[Text] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: Annotated[int, Field(ge=1, le=1, description="only n = 1 is served")] = 1
    ignore_eos: bool = False
    user: Text | None = None

    def _sampling(self, max_tokens: int | None, logprobs: int | None) -> SamplingParams:
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        temperature = 1.0 if self.temperature is None else self.temperature
        top_p = 1.0 if self.top_p is None else self.top_p
        greedy = temperature < GREEDY_BELOW or top_p < TOP_P_GREEDY_BELOW
        return SamplingParams(
            max_tokens=max_tokens,
            temperature=0.0 if greedy else temperature,
            top_p=1.0 if greedy else top_p,
            top_k=0 if self.top_k is None else self.top_k,
            seed=self.seed,
            stop=stop,
            logprobs=logprobs,
            ignore_eos=self.ignore_eos,
        )

    @property
    def include_usage(self) -> bool:
        """True when a streamed response must end with one usage chunk."""
        return bool(self.stream_options and self.stream_options.include_usage)


class CompletionRequest(_SamplingBody):
    """``POST /v1/completions``: a text prompt or a list of token ids."""

    prompt: Annotated[Text, Field(min_length=1)] | Annotated[list[TokenId], Field(min_length=1)]
    max_tokens: PositiveInt | None = None
    logprobs: Annotated[int, Field(ge=0, le=MAX_LOGPROBS)] | None = None
    echo: Literal[False] = False

    def sampling_params(self) -> SamplingParams:
        """SamplingParams of this request (raises InvalidParameterError on bad values)."""
        return self._sampling(self.max_tokens, self.logprobs)


class ChatCompletionRequest(_SamplingBody):
    """``POST /v1/chat/completions``: messages rendered by the model's chat template."""

    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_tokens: PositiveInt | None = None
    max_completion_tokens: PositiveInt | None = None
    logprobs: bool = False
    top_logprobs: Annotated[int, Field(ge=0, le=MAX_LOGPROBS)] | None = None

    @model_validator(mode="after")
    def _top_logprobs_needs_logprobs(self) -> ChatCompletionRequest:
        if self.top_logprobs and not self.logprobs:
            raise ValueError("top_logprobs requires logprobs to be true")
        return self

    def template_messages(self) -> list[dict[str, str]]:
        """Messages as chat-template dicts."""
        return [m.as_template_dict() for m in self.messages]

    def sampling_params(self) -> SamplingParams:
        """SamplingParams of this request (raises InvalidParameterError on bad values)."""
        max_tokens = self.max_completion_tokens or self.max_tokens
        logprobs = (self.top_logprobs or 0) if self.logprobs else None
        return self._sampling(max_tokens, logprobs)


class TokenizeRequest(_Body):
    """``POST /tokenize``: exactly one of ``prompt`` (text) or ``messages`` (chat)."""

    model: Text | None = None
    prompt: Annotated[Text, Field(min_length=1)] | None = None
    messages: Annotated[list[ChatMessage], Field(min_length=1)] | None = None

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
