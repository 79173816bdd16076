"""Bodies and objects of the OpenAI Responses API (``/v1/responses``).

Request: ``input`` is a string or a list of items (messages, function calls, their outputs,
reasoning; :mod:`.input_items`), sent alone (stateless: the Agents SDK resends the whole
conversation) or after a stored conversation named by ``previous_response_id``; ``store: false``
keeps nothing; ``include`` values are honoured or refused by name. kvledger's extension field
``memory`` picks the memory policy of the turn (``full``, ``summary``, ``segment``).

Deviations, each to keep a conversation's ids growing by appends only: ``instructions`` on a
continuation replace the system turn (the kept turns follow it with their exact ids), but an
omitted ``instructions`` keeps the conversation's, where OpenAI would drop them; an omitted
``max_output_tokens`` reserves and caps the reply at
:data:`kvledger.sessions.service.DEFAULT_MAX_OUTPUT_TOKENS` tokens instead of "up to the
context"; ``truncation`` defaults to ``"disabled"`` as in OpenAI.

Response objects and stream events follow the OpenAI API reference: the streamed sequence is
``response.created``, ``response.in_progress``, ``response.output_item.added``,
``response.content_part.added``, ``response.output_text.delta`` (one per engine step with
text), ``response.output_text.done``, ``response.content_part.done``,
``response.output_item.done`` and ``response.completed`` (or ``response.failed``), each with a
``sequence_number``, framed as SSE ``event: TYPE`` + ``data: JSON``. The extension object
``kvledger`` carries the memory policy's view of the turn and server-side TTFT/TPOT/KV bytes.
"""

from __future__ import annotations

import json
import time
from typing import Annotated, Any, ClassVar, Literal

from pydantic import Field

from kvledger.engine.output.request_output import RequestOutput
from kvledger.server.openai.api_fields import RESPONSES_UNSUPPORTED, Neutral
from kvledger.server.openai.errors import UnsupportedParameterError
from kvledger.server.openai.formatters import cached_details
from kvledger.server.openai.protocol import PositiveInt, _SamplingBody
from kvledger.server.openai.protocol_types import Text
from kvledger.server.responses.input_items import InputItem, TurnItems, turn_items
from kvledger.server.responses.items import StreamedItems, output_items
from kvledger.server.tools.structured_protocol import (
    FlatFunctionTool,
    FlatNamedToolChoice,
    TextOptions,
    ToolChoiceMode,
)

INCLUDE_HONOURED = frozenset((  # values whose items a response here never has: nothing to add
    "reasoning.encrypted_content", "file_search_call.results", "web_search_call.results",
    "web_search_call.action.sources", "code_interpreter_call.outputs",
    "computer_call_output.output.image_url", "message.input_image.image_url"))


class ResponsesRequest(_SamplingBody):
    """``POST /v1/responses``."""

    unsupported: ClassVar[dict[str, Neutral]] = RESPONSES_UNSUPPORTED

    input: Annotated[Text, Field(min_length=1)] | Annotated[list[InputItem],
                                                            Field(min_length=1)]
    instructions: Text | None = None
    previous_response_id: Text | None = None
    store: bool = True
    include: list[Text] | None = None
    max_output_tokens: PositiveInt | None = None
    truncation: Literal["disabled", "auto"] | None = None
    memory: Literal["full", "summary", "segment"] | None = None
    metadata: dict[str, str] | None = None
    text: TextOptions | None = None
    tools: list[FlatFunctionTool] | None = None
    tool_choice: ToolChoiceMode | FlatNamedToolChoice | None = None
    parallel_tool_calls: bool = True

    def check_include(self) -> None:
        """``include`` values are honoured (:data:`INCLUDE_HONOURED`: the items they extend
        never occur here) or refused by name.

        Raises:
            UnsupportedParameterError: naming the first value not served (HTTP 400).
        """
        for value in self.include or []:
            if value not in INCLUDE_HONOURED:
                raise UnsupportedParameterError(
                    "include", f"'include' value {value!r} is not served (output logprobs are "
                               "on /v1/chat/completions); served: "
                               + ", ".join(sorted(INCLUDE_HONOURED)))

    def turn(self, previous_calls: set[str] | None) -> TurnItems:
        """The turn of ``input`` (:func:`.input_items.turn_items`)."""
        return turn_items(self.input, previous_calls)


def usage(out: RequestOutput) -> dict:
    """Responses API ``usage`` (tokens) with the prefix-cache hits as ``cached_tokens``."""
    prompt, output = len(out.prompt_token_ids), len(out.token_ids)
    return {"input_tokens": prompt,
            "input_tokens_details": cached_details([out.metrics]),
            "output_tokens": output, "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": prompt + output}


def _tool_choice(body: ResponsesRequest):
    """``tool_choice`` as a response shows it."""
    choice = body.tool_choice
    if choice is None:
        return "auto" if body.tools else "none"
    return choice if isinstance(choice, str) else choice.model_dump()


def server_timings(out: RequestOutput) -> dict:
    """Server-side TTFT and TPOT (seconds) and the request's peak KV bytes."""
    return {"ttft_s": out.metrics.ttft_s, "tpot_s": out.tpot_s,
            "kv_bytes": out.metrics.peak_kv_bytes}


class ResponseBuilder:
    """The response object and the stream events of one turn (``tools``: the request's
    ``ToolPlan``, whose calls become ``function_call`` items, :mod:`.items`)."""

    def __init__(self, response_id: str, model: str, body: ResponsesRequest,
                 extension: dict[str, Any], tools=None) -> None:
        self.id = response_id
        self.tools = tools
        self.streamed = StreamedItems(self, tools.parser()) if tools is not None else None
        self.message_id = "msg_" + response_id.removeprefix("resp_")
        self.model = model
        self.body = body
        self.extension = extension
        self.created_at = int(time.time())
        self._seq = 0

    def message_item(self, text: str, status: str) -> dict:
        """The ``message`` output item with ``text``."""
        content = [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}]
        return {"id": self.message_id, "type": "message", "status": status, "role": "assistant",
                "content": content if status != "in_progress" else []}

    def response(self, out: RequestOutput | None = None, error: dict | None = None) -> dict:
        """The response object: in progress (no ``out``), finished, or failed (``error``)."""
        b = self.body
        status, incomplete = "in_progress", None
        if error is not None:
            status = "failed"
        elif out is not None:
            status = "incomplete" if out.finish_reason == "length" else "completed"
            incomplete = {"reason": "max_output_tokens"} if status == "incomplete" else None
        finished = out is not None and error is None
        output = []
        if finished:
            output = ([self.message_item(out.text, status)] if self.tools is None else
                      output_items(self, self.tools.parser(), out.text, status))
        text_format = b.text.format.echo() if b.text and b.text.format else {"type": "text"}
        return {
            "id": self.id, "object": "response", "created_at": self.created_at,
            "status": status, "error": error, "incomplete_details": incomplete,
            "model": self.model, "instructions": b.instructions,
            "output": output,
            "previous_response_id": b.previous_response_id, "store": b.store,
            "max_output_tokens": b.max_output_tokens, "temperature": b.temperature,
            "top_p": b.top_p, "truncation": b.truncation or "disabled",
            "parallel_tool_calls": b.parallel_tool_calls, "tool_choice": _tool_choice(b),
            "tools": [t.model_dump(exclude_none=True) for t in b.tools or []],
            "text": {"format": text_format}, "metadata": b.metadata or {},
            "usage": usage(out) if finished else None,
            "kvledger": {**self.extension, **(server_timings(out) if finished else {})},
        }

    def event(self, kind: str, **fields: Any) -> str:
        """One SSE event of type ``kind`` with the next sequence number."""
        payload = {"type": kind, "sequence_number": self._seq, **fields}
        self._seq += 1
        return f"event: {kind}\ndata: {json.dumps(payload, ensure_ascii=False)}\n\n"

    def opening(self) -> str:
        """Events before the first token: created, in_progress, the empty message and part
        (with tools, items open as their first piece arrives)."""
        item = {"item_id": self.message_id, "output_index": 0}
        started = (self.event("response.created", response=self.response())
                   + self.event("response.in_progress", response=self.response()))
        if self.streamed is not None:
            return started
        return started + "".join((
            self.event("response.output_item.added", output_index=0,
                       item=self.message_item("", "in_progress")),
            self.event("response.content_part.added", **item, content_index=0,
                       part={"type": "output_text", "text": "", "annotations": []}),
        ))

    def delta(self, text: str) -> str:
        """One text delta."""
        if self.streamed is not None:
            return self.streamed.feed(text)
        return self.event("response.output_text.delta", item_id=self.message_id, output_index=0,
                          content_index=0, delta=text, logprobs=[])

    def closing(self, out: RequestOutput, final: dict) -> str:
        """Events after the last token, ending with ``response.completed`` (or
        ``response.incomplete`` when max_output_tokens cut the reply)."""
        if self.streamed is not None:
            return (self.streamed.feed("", finished=True)
                    + self.event(f"response.{final['status']}", response=final))
        item = {"item_id": self.message_id, "output_index": 0, "content_index": 0}
        part = {"type": "output_text", "text": out.text, "annotations": []}
        return "".join((
            self.event("response.output_text.done", **item, text=out.text, logprobs=[]),
            self.event("response.content_part.done", **item, part=part),
            self.event("response.output_item.done", output_index=0,
                       item=final["output"][0]),
            self.event(f"response.{final['status']}", response=final),
        ))

    def failed(self, code: str, message: str) -> str:
        """The ``response.failed`` event of a turn the engine could not finish."""
        return self.event("response.failed",
                          response=self.response(error={"code": code, "message": message}))
