"""The ``input`` items of a Responses request, as the chat messages of one turn.

``input`` is a string (one user message) or a list of items, in order:

- ``message`` (``type`` optional): ``user``, ``system``, ``developer`` or ``assistant``; its
  content a string or a list of ``input_text`` / ``output_text`` / ``refusal`` parts and, for a
  user, ``input_file`` parts (``file_data``: base64 of a UTF-8 text file, :mod:`kvledger.
  sessions.retrieval`);
- ``function_call``: a call the model made (``call_id``, ``name``, ``arguments``), joined to the
  assistant message before it;
- ``function_call_output``: the result of a call of this input or of the previous response;
- ``reasoning``: accepted and not rendered (the served models' templates have no place for
  another run's reasoning, and kvledger writes none).

System and developer text joins the instructions (the conversation's system turn). A turn of
only user messages is one user turn of their joined text (and the documents); any other turn is
a list of chat messages (``assistant`` with ``tool_calls``, ``tool``) that the chat template
renders after the stored conversation, or after the system turn when there is none: so the
OpenAI Agents SDK, which resends the whole conversation without ``previous_response_id``, and a
client that continues a stored one with ``previous_response_id`` both work.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Annotated, Literal

from pydantic import Field

from kvledger.errors import InvalidParameterError
from kvledger.server.openai.protocol import ChatMessage
from kvledger.server.openai.protocol_types import Text, _Part
from kvledger.server.tools.structured_protocol import ToolCallFunction, ToolCallItem


class InputText(_Part):
    """A text part (``input_text``; ``text`` and an assistant's ``output_text`` too)."""

    type: Literal["input_text", "text", "output_text"]
    text: Text


class Refusal(_Part):
    """An assistant's refusal part (its text is what the assistant said)."""

    type: Literal["refusal"]
    refusal: Text


class InputFile(_Part):
    """A document part; only inline ``file_data`` (base64 UTF-8 text) is served."""

    type: Literal["input_file"]
    file_data: str | None = None
    filename: Text = "document.txt"
    file_id: str | None = None
    file_url: str | None = None


Part = Annotated[InputText | Refusal | InputFile, Field(discriminator="type")]


class InputMessage(_Part):
    """One input message."""

    type: Literal["message"] = "message"
    role: Literal["user", "system", "developer", "assistant"]
    content: Text | list[Part]


class FunctionCallOutput(_Part):
    """The result of a function call (of this input, or of the previous response)."""

    type: Literal["function_call_output"]
    call_id: Text
    output: Text | list[InputText]

    def text(self) -> str:
        """The output as text (text parts joined)."""
        return self.output if isinstance(self.output, str) else \
            "".join(p.text for p in self.output)


class FunctionCallInput(_Part):
    """A call the model made, sent back as history."""

    type: Literal["function_call"]
    call_id: Text
    name: Text
    arguments: Text


class ReasoningInput(_Part):
    """A reasoning item of an earlier response (accepted, not rendered)."""

    type: Literal["reasoning"]


InputItem = InputMessage | FunctionCallOutput | FunctionCallInput | ReasoningInput


@dataclass
class TurnItems:
    """One turn's input: the user text, the documents ``(filename, file_data)``, the extra
    system text, and the chat messages when the turn is more than user text (else None)."""

    text: str
    documents: list[tuple[str, str]] = field(default_factory=list)
    system: str | None = None
    messages: list[ChatMessage] | None = None


def _parts(message: InputMessage) -> list:
    if isinstance(message.content, str):
        return [InputText(type="input_text", text=message.content)]
    return message.content


def _text(parts: list) -> str:
    return "".join(p.refusal if isinstance(p, Refusal) else p.text for p in parts
                   if not isinstance(p, InputFile))


def _documents(parts: list) -> list[tuple[str, str]]:
    """The inline documents of a message's parts.

    Raises:
        InvalidParameterError: a file part without ``file_data``.
    """
    files = [p for p in parts if isinstance(p, InputFile)]
    for f in files:
        if f.file_data is None:
            raise InvalidParameterError(f"input_file {f.filename!r}: only inline file_data is "
                                        "served (no file_id or file_url)")
    return [(f.filename, f.file_data) for f in files]


def turn_items(items: str | list, previous_calls: set[str] | None) -> TurnItems:
    """The turn of a request's ``input`` (``previous_calls``: the ``call_id`` of each function
    call the previous response made; None without ``previous_response_id``).

    Raises:
        InvalidParameterError: a result for a call neither this input nor the previous
            response made, a file part without ``file_data``, or nothing to answer.
    """
    if isinstance(items, str):
        return TurnItems(items)
    system, documents, messages = [], [], []
    called = set(previous_calls or ())
    for item in items:
        if isinstance(item, ReasoningInput):
            continue
        if isinstance(item, FunctionCallInput):
            call = ToolCallItem(id=item.call_id, function=ToolCallFunction(
                name=item.name, arguments=item.arguments))
            called.add(item.call_id)
            last = messages[-1] if messages else None
            if last is not None and last.role == "assistant":
                last.tool_calls = [*(last.tool_calls or []), call]
            else:
                messages.append(ChatMessage(role="assistant", content="", tool_calls=[call]))
        elif isinstance(item, FunctionCallOutput):
            if item.call_id not in called:
                raise InvalidParameterError(_no_call(item.call_id, previous_calls))
            messages.append(ChatMessage(role="tool", content=item.text(),
                                        tool_call_id=item.call_id))
        elif item.role in ("system", "developer"):
            system.append(_text(_parts(item)))
        else:
            parts = _parts(item)
            if item.role == "user":
                documents += _documents(parts)
            messages.append(ChatMessage(role=item.role, content=_text(parts)))
    extra = "\n\n".join(system) or None
    if all(m.role == "user" for m in messages):
        text = "\n\n".join(m.content for m in messages if m.content)
        if not text and not documents:
            raise InvalidParameterError("'input' has no user message")
        return TurnItems(text or "Please read the attached document.", documents, extra)
    answered = {m.tool_call_id for m in messages if m.role == "tool"}
    for m in messages:
        for call in m.tool_calls or []:
            if call.id not in answered:
                raise InvalidParameterError(f"function_call {call.id!r} in 'input' has no "
                                            "function_call_output after it")
    if messages[-1].role == "assistant":
        raise InvalidParameterError("'input' ends with an assistant message: nothing to answer "
                                    "(end it with a user message or a function_call_output)")
    text = "\n\n".join(m.as_template_dict()["content"] for m in messages)
    return TurnItems(text, documents, extra, messages)


def _no_call(call_id: str, previous_calls: set[str] | None) -> str:
    where = ("in 'input' or the previous response" if previous_calls is not None else
             "in 'input' (send its function_call item before it, or continue the stored "
             "conversation with previous_response_id)")
    return f"function_call_output: no function call with call_id {call_id!r} {where}"
