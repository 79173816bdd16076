"""Request fields of structured output and tools, as the OpenAI API and vLLM spell them.

- Chat Completions: ``response_format`` (``text``, ``json_object``, ``json_schema`` with
  ``name``, ``schema``, ``strict``), ``tools`` (``{"type": "function", "function": {name,
  description, parameters, strict}}``), ``tool_choice`` (``none``, ``auto``, ``required`` or
  ``{"type": "function", "function": {"name"}}``), ``parallel_tool_calls``; assistant messages'
  ``tool_calls`` and ``tool`` messages' ``tool_call_id``.
- Responses: ``text.format`` (``text``, ``json_object``, ``json_schema`` with the schema's
  fields flat), flat function tools (``{"type": "function", name, description, parameters,
  strict}``) and ``tool_choice`` ``{"type": "function", "name"}``.
- vLLM's ``structured_outputs`` object (``json``, ``json_object``, ``regex``, ``choice``,
  ``grammar``); its other keys are refused, not ignored.

A function name follows OpenAI's rule (``^[a-zA-Z0-9_-]{1,64}$``). ``strict`` is accepted and
echoed; a given schema is always enforced.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import ConfigDict, Field, model_validator

from kvledger.engine.sample.structured.constraint import StructuredOutputsParams
from kvledger.server.openai.protocol_types import Text, _Part

FunctionName = Annotated[str, Field(pattern=r"^[a-zA-Z0-9_-]{1,64}$")]
Schema = dict[str, Any]


class StructuredOutputsBody(_Part):
    """vLLM's ``structured_outputs``: exactly one constraint."""

    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)

    json_: Schema | Text | None = Field(default=None, alias="json")
    json_object: bool | None = None
    regex: Text | None = None
    choice: list[Text] | None = None
    grammar: Text | None = None

    def params(self) -> StructuredOutputsParams:
        """The engine's constraint (raises InvalidParameterError: none or several set)."""
        return StructuredOutputsParams(**self.model_dump(by_alias=True, exclude_none=True))


class JsonSchemaSpec(_Part):
    """``response_format.json_schema``."""

    name: Annotated[str, Field(pattern=r"^[a-zA-Z0-9_-]{1,64}$")]
    description: Text | None = None
    schema_: Schema | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Part):
    """Chat ``response_format``."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaSpec | None = None

    @model_validator(mode="after")
    def _schema_given(self) -> ResponseFormat:
        if self.type == "json_schema" and self.json_schema is None:
            raise ValueError("needs 'json_schema' when its type is json_schema")
        return self

    def schema(self) -> Schema | None:
        """The JSON schema the reply must match (``{"type": "object"}`` for json_object and for
        a json_schema without one), None for text."""
        if self.type == "json_object":
            return {"type": "object"}
        if self.type == "json_schema":
            return self.json_schema.schema_ or {"type": "object"}
        return None


class TextFormat(_Part):
    """Responses ``text.format``: the json_schema fields are flat."""

    type: Literal["text", "json_object", "json_schema"]
    name: Annotated[str, Field(pattern=r"^[a-zA-Z0-9_-]{1,64}$")] | None = None
    description: Text | None = None
    schema_: Schema | None = Field(default=None, alias="schema")
    strict: bool | None = None

    @model_validator(mode="after")
    def _schema_given(self) -> TextFormat:
        if self.type == "json_schema" and (self.schema_ is None or self.name is None):
            raise ValueError("needs 'name' and 'schema' when its type is json_schema")
        return self

    def schema(self) -> Schema | None:
        """As :meth:`ResponseFormat.schema`."""
        return {"type": "object"} if self.type == "json_object" else self.schema_

    def echo(self) -> dict:
        """The format as a response object shows it (``strict`` included)."""
        return self.model_dump(by_alias=True, exclude_none=True)


class TextOptions(_Part):
    """Responses ``text``: ``verbosity`` is refused away from ``medium`` (``api_fields.py``)."""

    format: TextFormat | None = None
    verbosity: Text | None = None


class FunctionDefinition(_Part):
    """A function the model may call."""

    name: FunctionName
    description: Text | None = None
    parameters: Schema | None = None
    strict: bool | None = None

    def declaration(self) -> dict:
        """``{"type": "function", "function": {...}}``: how templates and prompts see it."""
        return {"type": "function", "function": self.model_dump(exclude_none=True)}


class ChatTool(_Part):
    """A Chat Completions tool."""

    type: Literal["function"]
    function: FunctionDefinition


class FlatFunctionTool(_Part):
    """A Responses API tool: the function's fields flat."""

    type: Literal["function"]
    name: FunctionName
    description: Text | None = None
    parameters: Schema | None = None
    strict: bool | None = None

    def function(self) -> FunctionDefinition:
        """The same function as Chat Completions nests it."""
        return FunctionDefinition(**self.model_dump(exclude={"type"}))


class FunctionRef(_Part):
    """``{"name": ...}``."""

    name: Text


class ChatNamedToolChoice(_Part):
    """``{"type": "function", "function": {"name"}}``."""

    type: Literal["function"]
    function: FunctionRef


class FlatNamedToolChoice(_Part):
    """Responses ``{"type": "function", "name"}``."""

    type: Literal["function"]
    name: Text


ToolChoiceMode = Literal["none", "auto", "required"]


class ToolCallFunction(_Part):
    """A call's function: its name and its arguments as JSON text."""

    name: Text
    arguments: Text


class ToolCallItem(_Part):
    """An assistant message's ``tool_calls[i]``."""

    id: Text
    type: Literal["function"] = "function"
    function: ToolCallFunction
