"""What tools and output formats change in one request: the prompt, the constraint, the parser.

- The **constraint** (``SamplingParams.structured_outputs``) comes from ``response_format`` /
  ``text.format`` or vLLM's ``structured_outputs`` (not both), or, when tools may be called,
  from :func:`~kvledger.server.tools.formats.tool_grammar` (the format's JSON schema then
  constrains a reply without calls under ``auto``).
- The **prompt**: a chat template that references ``tools`` gets them (and the conversation's
  earlier calls and results as ``tool_calls`` / ``tool`` messages); any other template gets the
  Hermes declaration in the system message, earlier calls as the assistant's ``<tool_call>``
  text and results as ``tool`` turns where the template renders that role, else as user turns
  naming the function (:func:`~kvledger.server.tools.formats.tool_result_message`).
- The **parser** of the reply (:class:`~kvledger.server.tools.parser.ToolCallParser`).

Refused with a 400 naming the problem: a ``tool_choice`` other than none/auto without tools, a
named function that is not declared, two tools of one name, ``required`` or a named function
together with a JSON format, ``structured_outputs`` together with tools or a format.
``tool_choice`` ``none`` declares no tools (the model is not told about them).
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from kvledger.engine.sample.structured.constraint import StructuredOutputsParams
from kvledger.server.openai.errors import UnsupportedParameterError
from kvledger.server.tools.formats import (
    ToolFormat,
    hermes_system_text,
    hidden_trigger_id,
    template_format,
    tool_grammar,
    tool_result_message,
)
from kvledger.server.tools.parser import ToolCallParser
from kvledger.server.tools.structured_protocol import FunctionDefinition


@dataclass(frozen=True)
class ToolPlan:
    """The tools of one request that may call them.

    Attributes:
        functions: the declared functions.
        fmt: the model's tool-call format; ``native`` when its template renders tools.
        mode: ``auto``, ``required`` or ``named`` (``named`` is then the function).
        parallel: more than one call allowed (``parallel_tool_calls``).
        trigger_id: the format's trigger when it is a special token absent from the text.
    """

    functions: tuple[FunctionDefinition, ...]
    fmt: ToolFormat
    native: bool
    mode: str
    named: str | None
    parallel: bool
    trigger_id: int | None

    def constraint(self, text_schema: dict | None) -> StructuredOutputsParams:
        """The grammar of a reply (``text_schema``: what a reply without calls matches)."""
        functions = [{"name": f.name, "parameters": f.parameters} for f in self.functions]
        return StructuredOutputsParams(grammar=tool_grammar(
            self.fmt, functions, self.mode, self.parallel, self.named, text_schema,
            self.trigger_id))

    def parser(self) -> ToolCallParser:
        """A parser for one reply."""
        return ToolCallParser(self.fmt, trigger_visible=self.trigger_id is None)

    def declarations(self) -> list[dict]:
        """The tools as templates and the Hermes prompt declare them."""
        return [f.declaration() for f in self.functions]


def _choice(tool_choice, names: list[str]) -> tuple[str, str | None]:
    """(mode, named function) of a ``tool_choice`` (a mode string or a named choice)."""
    if tool_choice is None:
        return ("auto" if names else "none"), None
    if isinstance(tool_choice, str):
        if tool_choice == "required" and not names:
            raise UnsupportedParameterError(
                "tool_choice", "'tool_choice' is 'required' but the request has no 'tools'")
        return tool_choice, None
    name = tool_choice.name if hasattr(tool_choice, "name") else tool_choice.function.name
    if name not in names:
        raise UnsupportedParameterError(
            "tool_choice", f"'tool_choice' names the function {name!r}, which is not among "
                           f"the tools ({', '.join(names) or 'none given'})")
    return "named", name


def plan_tools(functions: list[FunctionDefinition], tool_choice, parallel: bool,
               text_schema: dict | None, tokenizer, model: str) -> ToolPlan | None:
    """The tool plan of a request, or None when no call can come back.

    Raises:
        UnsupportedParameterError, InvalidParameterError: see the module docstring.
    """
    names = [f.name for f in functions]
    duplicate = next((n for i, n in enumerate(names) if n in names[:i]), None)
    if duplicate is not None:
        raise UnsupportedParameterError("tools", f"two tools are named {duplicate!r}")
    mode, named = _choice(tool_choice, names)
    if mode == "none" or not names:
        return None
    if mode != "auto" and text_schema is not None:
        raise UnsupportedParameterError(
            "tool_choice", f"'tool_choice' {'required' if mode == 'required' else named!r} "
                           "forces a tool call, which conflicts with the JSON response format; "
                           "use tool_choice 'auto' or drop the format")
    fmt, native = template_format(getattr(tokenizer, "chat_template", None), model)
    trigger = hidden_trigger_id(tokenizer, fmt) if native else None
    return ToolPlan(tuple(functions), fmt, native, mode, named, parallel, trigger)


def output_constraint(schema: dict | None, structured, plan: ToolPlan | None
                      ) -> StructuredOutputsParams | None:
    """The request's constraint from its format's JSON ``schema``, vLLM's ``structured``
    object and its tool plan.

    Raises:
        UnsupportedParameterError: ``structured_outputs`` together with a format or tools.
    """
    if structured is not None:
        if schema is not None or plan is not None:
            raise UnsupportedParameterError(
                "structured_outputs", "'structured_outputs' cannot be combined with a response "
                                      "format or with tools; send one of them")
        return structured.params()
    if plan is not None:
        return plan.constraint(schema)
    return None if schema is None else StructuredOutputsParams(json=schema)


def _arguments(text: str):
    """A call's arguments as a template expects them: the object, else the text as given."""
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


def template_messages(messages: list, plan: ToolPlan | None, tokenizer, model: str
                      ) -> tuple[list[dict], list[dict] | None]:
    """The chat-template messages of a conversation and the tools to pass to the template
    (None when the template is not given tools).

    Raises:
        InvalidParameterError: tool history for a template whose tool format is unknown.
    """
    history = any(m.role == "tool" or m.tool_calls for m in messages)
    if plan is None and not history:
        return [m.as_template_dict() for m in messages], None
    fmt, native = ((plan.fmt, plan.native) if plan is not None else
                   template_format(getattr(tokenizer, "chat_template", None), model))
    if native:
        return [_native(m) for m in messages], plan.declarations() if plan else None
    names = {c.id: c.function.name for m in messages for c in m.tool_calls or []}
    tool_role = renders_tool_role(tokenizer)
    out = [_hermes(m, fmt, names, tool_role) for m in messages]
    if plan is not None:
        declared = hermes_system_text(plan.declarations())
        if out and out[0]["role"] in ("system", "developer"):
            out[0] = {**out[0], "content": out[0]["content"] + "\n\n" + declared}
        else:
            out.insert(0, {"role": "system", "content": declared})
    return out, None


def _native(message) -> dict:
    out = message.as_template_dict()
    if message.tool_calls:
        out["tool_calls"] = [{"id": c.id, "type": "function", "function": {
            "name": c.function.name, "arguments": _arguments(c.function.arguments)}}
            for c in message.tool_calls]
    if message.role == "tool" and message.tool_call_id is not None:
        out["tool_call_id"] = message.tool_call_id
    return out


_ROLE_PROBE = "\x00result\x00"


def renders_tool_role(tokenizer) -> bool:
    """Whether the tokenizer's chat template writes a ``tool`` turn (renders it, content and
    role name included) rather than raising or dropping it."""
    messages = [{"role": "user", "content": "u"}, {"role": "tool", "content": _ROLE_PROBE}]
    try:
        text = tokenizer.apply_chat_template(messages, tokenize=False)
    except Exception:  # noqa: BLE001 - a template that raises on the role, or none at all
        return False
    return isinstance(text, str) and _ROLE_PROBE in text and "tool" in text.replace(
        _ROLE_PROBE, "")


def _hermes(message, fmt: ToolFormat, names: dict[str, str], tool_role: bool) -> dict:
    out = message.as_template_dict()
    if message.role == "tool":
        return tool_result_message(out["content"], names.get(message.tool_call_id), tool_role)
    if message.tool_calls:
        calls = "\n".join(fmt.call_text(c.function.name, c.function.arguments)
                          for c in message.tool_calls)
        out["content"] = (out["content"] + "\n" if out["content"] else "") + calls
    return out
