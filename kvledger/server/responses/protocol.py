"""Bodies and objects of the OpenAI Responses API (``/v1/responses``).

Request: ``input`` is a string or a list of messages (``{"role", "content"}``, optionally
``"type": "message"``) whose content is a string or a list of ``input_text`` and
``input_file`` parts (``file_data`` base64 of a UTF-8 text file). The user and system
messages of one request form one turn (system/developer text joins the instructions of a new
conversation); assistant messages in ``input`` are refused: history lives on the server
through ``previous_response_id``. kvledger's extension field ``memory`` picks the memory
policy of the turn (``full``, ``summary``, ``segment``).

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
from kvledger.errors import InvalidParameterError
from kvledger.server.openai.api_fields import RESPONSES_UNSUPPORTED, Neutral
from kvledger.server.openai.formatters import cached_details
from kvledger.server.openai.protocol import PositiveInt, _SamplingBody
from kvledger.server.openai.protocol_types import Text, _Part
from kvledger.server.responses.items import StreamedItems, output_items
from kvledger.server.tools.formats import tool_response_text
from kvledger.server.tools.structured_protocol import (
    FlatFunctionTool,
    FlatNamedToolChoice,
    TextOptions,
    ToolChoiceMode,
)


class InputText(_Part):
    """A text part (``input_text``; ``text`` accepted too)."""

    type: Literal["input_text", "text"]
    text: Text


class InputFile(_Part):
    """A document part; only inline ``file_data`` (base64 UTF-8 text) is served."""

    type: Literal["input_file"]
    file_data: str | None = None
    filename: Text = "document.txt"
    file_id: str | None = None
    file_url: str | None = None


Part = Annotated[InputText | InputFile, Field(discriminator="type")]


class InputMessage(_Part):
    """One input message."""

    type: Literal["message"] = "message"
    role: Literal["user", "system", "developer", "assistant"]
    content: Text | list[Part]


class FunctionCallOutput(_Part):
    """The result of a function call the previous response made."""

    type: Literal["function_call_output"]
    call_id: Text
    output: Text


class FunctionCallInput(_Part):
    """A call echoed back in ``input`` (refused: the conversation holds it already)."""

    type: Literal["function_call"]


InputItem = InputMessage | FunctionCallOutput | FunctionCallInput


class ResponsesRequest(_SamplingBody):
    """``POST /v1/responses``."""

    unsupported: ClassVar[dict[str, Neutral]] = RESPONSES_UNSUPPORTED

    input: Annotated[Text, Field(min_length=1)] | Annotated[list[InputItem],
                                                            Field(min_length=1)]
    instructions: Text | None = None
    previous_response_id: Text | None = None
    store: bool = True
    max_output_tokens: PositiveInt | None = None
    truncation: Literal["disabled", "auto"] | None = None
    memory: Literal["full", "summary", "segment"] | None = None
    metadata: dict[str, str] | None = None
    text: TextOptions | None = None
    tools: list[FlatFunctionTool] | None = None
    tool_choice: ToolChoiceMode | FlatNamedToolChoice | None = None
    parallel_tool_calls: bool = True

    def call_output_ids(self) -> list[str]:
        """The ``call_id`` of every ``function_call_output`` item of ``input``."""
        items = self.input if isinstance(self.input, list) else []
        return [item.call_id for item in items if isinstance(item, FunctionCallOutput)]

    def split_input(self) -> tuple[str, list[tuple[str, str]], str | None]:
        """(user text, documents as ``(filename, file_data)``, extra system text).

        Raises:
            InvalidParameterError: assistant messages or function calls, file parts without
                ``file_data``, or no user text.
        """
        if isinstance(self.input, str):
            return self.input, [], None
        user, system, documents = [], [], []
        for message in self.input:
            if isinstance(message, FunctionCallOutput):
                user.append(tool_response_text(message.output))
                continue
            if isinstance(message, FunctionCallInput):
                raise InvalidParameterError(
                    "function_call items in 'input' are not served: continue the conversation "
                    "with previous_response_id and send the function_call_output items")
            if message.role == "assistant":
                raise InvalidParameterError(
                    "assistant messages in 'input' are not served: continue a conversation "
                    "with previous_response_id")
            parts = ([InputText(type="input_text", text=message.content)]
                     if isinstance(message.content, str) else message.content)
            for part in parts:
                if isinstance(part, InputFile):
                    if part.file_data is None:
                        raise InvalidParameterError(
                            f"input_file {part.filename!r}: only inline file_data is served "
                            "(no file_id or file_url)")
                    documents.append((part.filename, part.file_data))
                elif message.role == "user":
                    user.append(part.text)
                else:
                    system.append(part.text)
        if not user and not documents:
            raise InvalidParameterError("'input' has no user message")
        text = "\n\n".join(user) or "Please read the attached document."
        return text, documents, "\n\n".join(system) or None


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
