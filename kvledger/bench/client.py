"""One streamed OpenAI-compatible request, timed the way the report defines it.

Definitions (seconds, ``time.perf_counter`` clock; "send" is the moment the request is handed
to httpx, after the client got its own concurrency slot):

- **TTFT** = send -> the first SSE event that carries generated content: a non-empty
  ``choices[0].delta.content`` (chat; ``delta.reasoning_content`` also counts) or
  ``choices[0].text`` (completions). A role-only first chunk (``delta: {"role": "assistant"}``),
  comments (``: keep-alive``), the usage chunk and ``[DONE]`` are not content.
- **E2E latency** = send -> the last byte of the response (after ``[DONE]``), as vLLM's
  benchmark defines it.
- **ITL** = every gap between consecutive content events (one event may carry several tokens).
- **TPOT** = (E2E - TTFT) / (output tokens - k), output tokens from the final ``usage`` chunk
  (``stream_options.include_usage``), k the tokens the client had when it saw the first content
  event: exact when the server reports usage in every chunk (vLLM's
  ``stream_options.continuous_usage_stats``, which the bench asks for; kvledger serve honours
  it), else taken as 1. Tokens that came before or with the first content event are part of
  TTFT, so they are not divided into TPOT. Undefined when no token follows the first event.

A stream is timed at the moment each network read arrives: every event completed by that read
gets the read's timestamp. A request that errors, returns a non-200 status or streams no content
is a failure with an error message, never a zero.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field

import httpx

from kvledger.bench.sse import SSEParser


@dataclass
class StreamResult:
    """What one streamed request measured. Times are seconds relative to send."""

    ok: bool = False
    error: str | None = None
    ttft_s: float | None = None
    e2e_s: float | None = None
    itl_s: list[float] = field(default_factory=list)
    output_tokens: int | None = None
    prompt_tokens: int | None = None
    content_events: int = 0
    first_event_tokens: int = 1  # output tokens delivered up to the first content event
    text: str = ""
    notes: list[str] = field(default_factory=list)

    @property
    def tpot_s(self) -> float | None:
        """(E2E - TTFT) / (output tokens - k); None when undefined (failure, no later token)."""
        return tpot(self.ttft_s, self.e2e_s, self.output_tokens, self.first_event_tokens)


def tpot(ttft_s: float | None, e2e_s: float | None, output_tokens: int | None,
         first_tokens: int = 1) -> float | None:
    """Time per output token after those of the first content event (``first_tokens``), in
    seconds; None when it is undefined."""
    if ttft_s is None or e2e_s is None or not output_tokens or output_tokens <= first_tokens:
        return None
    return (e2e_s - ttft_s) / (output_tokens - first_tokens)


def content_of(event: dict) -> str:
    """Generated text carried by one parsed chunk ('' for role-only, usage or empty chunks)."""
    choices = event.get("choices") or []
    if not choices or not isinstance(choices[0], dict):
        return ""
    choice = choices[0]
    delta = choice.get("delta")
    if isinstance(delta, dict):
        return (delta.get("content") or "") + (delta.get("reasoning_content") or "")
    return choice.get("text") or ""


class _Collector:
    """Accumulates parsed events of one stream into a StreamResult."""

    def __init__(self, sent: float) -> None:
        self.sent = sent
        self.times: list[float] = []
        self.parts: list[str] = []
        self.usage: dict | None = None
        self.first_tokens: int | None = None  # usage.completion_tokens at the first content
        self.error: str | None = None
        self.done = False
        self.malformed = 0

    def add(self, data: str, now: float) -> None:
        if data.strip() == "[DONE]":
            self.done = True
            return
        try:
            event = json.loads(data)
        except json.JSONDecodeError:
            self.malformed += 1
            return
        if not isinstance(event, dict):
            self.malformed += 1
            return
        if event.get("error"):
            err = event["error"]
            self.error = err.get("message", str(err)) if isinstance(err, dict) else str(err)
        if isinstance(event.get("usage"), dict):
            self.usage = event["usage"]
        text = content_of(event)
        if text and not self.times and isinstance(event.get("usage"), dict):
            tokens = event["usage"].get("completion_tokens")
            self.first_tokens = tokens if isinstance(tokens, int) and tokens >= 1 else None
        if text:
            self.times.append(now - self.sent)
            self.parts.append(text)

    def result(self, end: float) -> StreamResult:
        """The StreamResult; ``end`` is when the response's last byte arrived."""
        res = StreamResult(content_events=len(self.times), text="".join(self.parts))
        if self.malformed:
            res.notes.append(f"{self.malformed} event(s) were not JSON objects")
        if not self.done:
            res.notes.append("stream ended without [DONE]")
        if self.usage:
            res.prompt_tokens = self.usage.get("prompt_tokens")
            res.output_tokens = self.usage.get("completion_tokens")
        if self.error or not self.times:
            res.error = self.error or "the stream carried no generated content"
            return res
        res.ok = True
        res.ttft_s, res.e2e_s = self.times[0], end - self.sent
        res.first_event_tokens = self.first_tokens or 1
        res.itl_s = [b - a for a, b in zip(self.times, self.times[1:])]
        if res.output_tokens is None:
            res.output_tokens = len(self.times)
            res.notes.append("no usage chunk: output tokens counted as content events")
        return res


async def stream_request(
    client: httpx.AsyncClient, url: str, payload: dict, headers: dict | None = None
) -> StreamResult:
    """POST ``payload`` to ``url`` with streaming and time it (see the module definitions).

    Never raises for transport or HTTP errors: they come back as ``ok=False`` with ``error``.
    """
    sent = time.perf_counter()
    collector = _Collector(sent)
    parser = SSEParser()
    try:
        async with client.stream("POST", url, json=payload, headers=headers) as response:
            if response.status_code != 200:
                body = (await response.aread()).decode("utf-8", errors="replace")
                return StreamResult(error=f"HTTP {response.status_code}: {body[:300]}")
            async for piece in response.aiter_bytes():
                now = time.perf_counter()
                for data in parser.feed(piece):
                    collector.add(data, now)
            now = time.perf_counter()
            for data in parser.close():
                collector.add(data, now)
    except httpx.HTTPError as exc:
        return StreamResult(error=f"{type(exc).__name__}: {exc}")
    return collector.result(now)
