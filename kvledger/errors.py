"""User-facing errors.

Every mistake a user can make (bad config, unknown model path, prompt longer than the context,
KV budget too small, bad HTTP body) raises a subclass of :class:`KVLedgerError` with a one-line
message that says what was wrong and what to do. The CLI prints the message and exits with code
2; the server maps the class to an HTTP status. Anything else escaping is a bug.
"""


class KVLedgerError(Exception):
    """Base class of errors caused by the user's input (CLI exit code 2, HTTP 4xx)."""

    http_status = 400
    code: str | None = None  # a bad value: no code, as OpenAI sends (the type says invalid)


class ConfigError(KVLedgerError):
    """A model config or GGUF header is malformed or lacks a required key."""


class ModelNotFoundError(KVLedgerError):
    """A model path does not exist or names no loadable model."""

    http_status = 404
    code = "model_not_found"


class UnsupportedModelError(KVLedgerError):
    """A model uses an architecture or tensor type the engine cannot run."""


class ContextLengthError(KVLedgerError):
    """Prompt tokens + max_tokens exceed the model's context window."""

    code = "context_length_exceeded"


class KVBudgetError(KVLedgerError):
    """A request can never fit the KV pool or its per-request KV quota.

    A permanent refusal (HTTP 400, as for the context length): retrying cannot help, and the
    official OpenAI client retries a 429 on its own.
    """

    code = "kv_quota_exceeded"


class InvalidParameterError(KVLedgerError):
    """A sampling or engine parameter is out of range (e.g. max_tokens <= 0)."""
