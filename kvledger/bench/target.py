"""The server under test: base URL, auth, model discovery and API paths.

``kvledger bench`` talks HTTP only, so any OpenAI-compatible server works (kvledger serve,
vLLM, SGLang, llama.cpp's server). The user may give the base URL with or without ``/v1``;
``/v1/...`` routes hang below it, ``/tokenize`` and ``/metrics`` at its root (vLLM's layout).
"""

from __future__ import annotations

from dataclasses import dataclass

import httpx

from kvledger.errors import KVLedgerError


class BenchTargetError(KVLedgerError):
    """The server cannot be reached or does not answer the OpenAI API as expected."""


@dataclass
class Target:
    """Where requests go. ``base_url`` has no trailing ``/`` and no ``/v1``."""

    base_url: str
    api_key: str | None = None
    model: str = ""
    endpoint: str = "chat"  # "chat" or "completions"
    max_model_len: int | None = None

    @classmethod
    def from_url(cls, url: str, api_key: str | None = None, endpoint: str = "chat") -> Target:
        """Normalize ``url`` (``http://h:p``, ``http://h:p/``, ``http://h:p/v1`` are alike)."""
        if endpoint not in ("chat", "completions"):
            raise BenchTargetError(f"--endpoint must be chat or completions, not {endpoint!r}")
        base = url.strip().rstrip("/")
        if not base.startswith(("http://", "https://")):
            raise BenchTargetError(f"--url must start with http:// or https://, got {url!r}")
        base = base.removesuffix("/v1")
        return cls(base_url=base, api_key=api_key, endpoint=endpoint)

    @property
    def headers(self) -> dict[str, str]:
        """Authorization header when an API key is set."""
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    @property
    def generate_url(self) -> str:
        """The streaming endpoint: /v1/chat/completions or /v1/completions."""
        path = "chat/completions" if self.endpoint == "chat" else "completions"
        return f"{self.base_url}/v1/{path}"

    def discover(self, client: httpx.Client, model: str | None) -> None:
        """Set ``model`` (given, else the first of /v1/models) and ``max_model_len`` if listed.

        Raises:
            BenchTargetError: the server is unreachable, or lists no model and none was given.
        """
        try:
            response = client.get(f"{self.base_url}/v1/models", headers=self.headers)
        except httpx.HTTPError as exc:
            raise BenchTargetError(f"cannot reach {self.base_url}: {exc}") from None
        cards = []
        if response.status_code == 200:
            body = response.json()
            cards = body.get("data", []) if isinstance(body, dict) else []
        elif response.status_code in (401, 403):
            raise BenchTargetError(
                f"{self.base_url} refused the API key (HTTP {response.status_code}): "
                "pass --api-key or set $OPENAI_API_KEY"
            )
        elif model is None:
            hint = " (give the server's base URL, without /v1)" if response.status_code == 404 \
                else ""
            raise BenchTargetError(f"{self.base_url}/v1/models answered HTTP "
                                   f"{response.status_code}{hint}; or pass --model NAME")
        if model is None:
            if not cards:
                raise BenchTargetError(
                    f"{self.base_url}/v1/models lists no model: pass --model NAME"
                )
            model = cards[0]["id"]
        self.model = model
        for card in cards:
            if card.get("id") == model and isinstance(card.get("max_model_len"), int):
                self.max_model_len = card["max_model_len"]

    def payload(self, prompt: str | list[dict], output_len: int) -> dict:
        """Request body for a fixed output length: ``max_tokens`` + ``ignore_eos`` + usage.

        ``prompt`` is a string (completions, or one user message for chat) or a message list.
        """
        body: dict = {
            "model": self.model,
            "max_tokens": output_len,
            "ignore_eos": True,
            "temperature": 0.0,
            "stream": True,
            # usage in every chunk where supported (vLLM, kvledger): exact TPOT (bench.client)
            "stream_options": {"include_usage": True, "continuous_usage_stats": True},
        }
        if self.endpoint == "chat":
            messages = prompt if isinstance(prompt, list) else [{"role": "user", "content": prompt}]
            body["messages"] = messages
        else:
            body["prompt"] = prompt if isinstance(prompt, str) else render_messages(prompt)
        return body


def render_messages(messages: list[dict]) -> str:
    """Flatten chat messages into plain text for the completions endpoint."""
    return "".join(f"{m['role'].capitalize()}: {m['content']}\n" for m in messages) + "Assistant:"
