"""How chat templates write tool calls, and the grammar that makes a model write them.

A :class:`ToolFormat` is the literal layout of the calls one family of models emits:

- **Hermes** (Qwen2/2.5/3, Hermes 2 Pro, and kvledger's own prompt for templates that do not
  render tools, such as the bundled SmolLM2's): ``<tool_call>\\n{"name": "f", "arguments":
  {...}}\\n</tool_call>``, one block per call, blocks separated by a newline
  (https://qwen.readthedocs.io/en/latest/framework/function_call.html);
- **Llama 3.1 JSON** (custom tools): ``{"name": "f", "parameters": {...}}``, calls separated by
  ``; `` (https://www.llama.com/docs/model-cards-and-prompt-formats/llama3_1/);
- **Mistral**: ``[TOOL_CALLS][{"name": "f", "arguments": {...}}, ...]`` (``[TOOL_CALLS]`` is a
  special token in Mistral's tokenizers, so it is absent from the decoded text).

:func:`tool_grammar` writes the Lark grammar (llguidance's syntax, JSON schemas embedded with
``%json``) for a ``tool_choice``: under ``auto`` the output is free text until the format's
trigger appears, then only calls to declared functions with arguments matching their schema;
under ``required`` calls from the first token, at least one; a named function exactly one
call to it; ``parallel_tool_calls`` false at most one call.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from kvledger.engine.sample.structured.constraint import json_schema_options
from kvledger.errors import InvalidParameterError

ANY_OBJECT = {"type": "object"}


@dataclass(frozen=True)
class ToolFormat:
    """The literal text around the calls of one format.

    Attributes:
        name: the parser's name (as vLLM's ``--tool-call-parser``).
        trigger: what opens the calls (text, or the text of a special token).
        after_trigger: from the trigger to the first call's name.
        args_key: from the end of a name to its arguments (a JSON object).
        tail: after the arguments of a call.
        between: from one call's tail to the next call's name.
        close: after the last call.
    """

    name: str
    trigger: str
    after_trigger: str
    args_key: str
    tail: str
    between: str
    close: str

    def call_text(self, name: str, arguments: str) -> str:
        """One call as the model writes it (a conversation's earlier calls are rendered so)."""
        return self.trigger + self.after_trigger + name + self.args_key + arguments + self.tail


HERMES = ToolFormat("hermes", "<tool_call>", '\n{"name": "', '", "arguments": ',
                    "}\n</tool_call>", '\n<tool_call>\n{"name": "', "")
LLAMA3_JSON = ToolFormat("llama3_json", '{"name": "', "", '", "parameters": ', "}",
                         '; {"name": "', "")
MISTRAL = ToolFormat("mistral", "[TOOL_CALLS]", '[{"name": "', '", "arguments": ', "}",
                     ', {"name": "', "]")

HERMES_SYSTEM = """# Tools

You may call one or more functions to assist with the user query.

You are provided with function signatures within <tools></tools> XML tags:
<tools>
{tools}
</tools>

For each function call, return a json object with function name and arguments within \
<tool_call></tool_call> XML tags:
<tool_call>
{{"name": <function-name>, "arguments": <args-json-object>}}
</tool_call>"""


def hermes_system_text(tools: list[dict]) -> str:
    """The system text that declares ``tools`` (OpenAI ``{"type": "function", "function":
    ...}`` dicts) in Hermes' layout, for a template that does not render tools itself."""
    return HERMES_SYSTEM.format(tools="\n".join(json.dumps(t, ensure_ascii=False)
                                                for t in tools))


def tool_result_message(content: str, name: str | None, tool_role: bool) -> dict:
    """A tool result for a template that does not render tools: a ``tool`` turn where the
    template writes one (``tool_role``; ChatML templates such as SmolLM2's write any role),
    else a user turn naming the function. Not Hermes' ``<tool_response>`` user turn: the bundled
    model began its answers with that wrapper (measured, docs/clients.md#tool-results)."""
    if tool_role:
        return {"role": "tool", "content": content}
    return {"role": "user", "content": f"{name or 'The tool'} returned: {content}"}


def template_format(template: str | None, model: str) -> tuple[ToolFormat, bool]:
    """The tool format of a chat template, and whether the template renders tools itself.

    Raises:
        InvalidParameterError: the template renders tools in a format no parser here knows.
    """
    if not template or "tools" not in template:
        return HERMES, False
    for marker, fmt in (("<tool_call>", HERMES), ("[TOOL_CALLS]", MISTRAL),
                        ("<|python_tag|>", LLAMA3_JSON)):
        if marker in template:
            return fmt, True
    raise InvalidParameterError(
        f"the chat template of {model} renders tools in a format kvledger cannot parse (known: "
        "Hermes/Qwen <tool_call>, Llama-3.1 JSON, Mistral [TOOL_CALLS]); tool calls are not "
        "served for this model")


def hidden_trigger_id(tokenizer, fmt: ToolFormat) -> int | None:
    """The id of the format's trigger when it is one special token the decoded text omits
    (Mistral's ``[TOOL_CALLS]``), else None."""
    ids = tokenizer.encode(fmt.trigger, add_special_tokens=False)
    if len(ids) == 1 and tokenizer.decode(ids, skip_special_tokens=True) == "":
        return ids[0]
    return None


def _lit(text: str) -> str:
    return json.dumps(text, ensure_ascii=False)


def tool_grammar(fmt: ToolFormat, functions: list[dict], mode: str, parallel: bool,
                 named: str | None = None, text_schema: dict | None = None,
                 trigger_id: int | None = None) -> str:
    """The Lark grammar of a reply under tools.

    Args:
        functions: ``{"name", "parameters"}`` of every declared function.
        mode: ``auto``, ``required`` or ``named`` (then ``named`` is the function).
        parallel: more than one call allowed.
        text_schema: under ``auto``, the JSON schema a reply without calls must match.
        trigger_id: the trigger's token id when it is a hidden special token.
    """
    trigger = f"<[{trigger_id}]>" if trigger_id is not None else _lit(fmt.trigger)
    rules = ["%llguidance {}"]
    for i, f in enumerate(functions):
        schema = json.dumps(json_schema_options(f.get("parameters") or ANY_OBJECT))
        rules.append(f"call_{i}: {_lit(f['name'] + fmt.args_key)} %json {schema} "
                     f"{_lit(fmt.tail)}")
    if mode == "named":
        index = next(i for i, f in enumerate(functions) if f["name"] == named)
        calls = f"{_lit(fmt.after_trigger)} call_{index}"
    else:
        rules.append("call: " + " | ".join(f"call_{i}" for i in range(len(functions))))
        repeat = f" ({_lit(fmt.between)} call)*" if parallel else ""
        calls = f"{_lit(fmt.after_trigger)} call{repeat}"
    if fmt.close:
        calls += f" {_lit(fmt.close)}"
    rules.append(f"calls: {calls}")
    if mode != "auto":
        rules.append(f"start: {trigger} calls")
    elif text_schema is not None:
        rules.append(f"start: %json {json.dumps(json_schema_options(text_schema))} "
                     f"| {trigger} calls")
    else:
        lazy = "" if trigger_id is not None else "[lazy]"
        rules += ["start: TEXT | trig calls", f"trig{lazy}: TEXT {trigger}",
                  "TEXT: /(.|\\n)*/"]
    return "\n".join(rules) + "\n"
