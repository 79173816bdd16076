"""Tool formats: template detection, and the grammar of each tool_choice judged by what it lets
the bundled tokenizer's tokens spell."""

from __future__ import annotations

import json

import pytest

from kvledger.engine.sample.structured.constraint import StructuredOutputsParams
from kvledger.errors import InvalidParameterError
from kvledger.server.tools.formats import (
    HERMES,
    LLAMA3_JSON,
    MISTRAL,
    hidden_trigger_id,
    template_format,
    tool_grammar,
)

WEATHER = {"name": "get_weather", "parameters": {
    "type": "object", "required": ["city"], "additionalProperties": False,
    "properties": {"city": {"type": "string"}, "unit": {"enum": ["c", "f"]}}}}
TIME = {"name": "get_time", "parameters": None}
PARIS = '{"city": "Paris"}'


def _accepts(grammars, tokenizer, grammar: str, text: str) -> bool:
    """True when the grammar takes ``text`` and is then complete."""
    matcher = grammars.matcher(StructuredOutputsParams(grammar=grammar))
    ids = tokenizer.encode(text, add_special_tokens=False)
    return all(matcher.consume_token(t) for t in ids) and matcher.is_accepting()


@pytest.mark.parametrize("template, expected", [
    (None, (HERMES, False)),
    ("{% for m in messages %}{{ m.content }}{% endfor %}", (HERMES, False)),
    ("{% if tools %}<tool_call>{% endif %}", (HERMES, True)),
    ("{% if tools %}[TOOL_CALLS]{% endif %}", (MISTRAL, True)),
    ("{% if tools %}<|python_tag|>{% endif %}", (LLAMA3_JSON, True)),
])
def test_template_detection(template, expected):
    assert template_format(template, "m") == expected


def test_an_unknown_tool_template_is_refused_naming_the_model():
    with pytest.raises(InvalidParameterError, match="chat template of acme-7b"):
        template_format("{% for t in tools %}<call>{% endfor %}", "acme-7b")


def test_plain_text_trigger_is_not_hidden(bundled_tokenizer):
    assert hidden_trigger_id(bundled_tokenizer, HERMES) is None


@pytest.mark.parametrize("fmt", [HERMES, LLAMA3_JSON, MISTRAL], ids=lambda f: f.name)
def test_auto_is_free_text_until_the_trigger_then_only_declared_calls(grammars,
                                                                      bundled_tokenizer, fmt):
    g = tool_grammar(fmt, [WEATHER, TIME], "auto", parallel=True)
    ok = fmt.call_text("get_weather", PARIS)
    two = ok[:-len(fmt.tail)] + fmt.tail + fmt.between + 'get_time' + fmt.args_key + "{}" + \
        fmt.tail + fmt.close
    check = lambda text: _accepts(grammars, bundled_tokenizer, g, text)
    assert check("Just text, no call.")
    assert check("Let me look. " + ok + fmt.close)
    assert check(two)
    assert not check(fmt.call_text("get_news", PARIS) + fmt.close)  # undeclared function
    assert not check(fmt.call_text("get_weather", '{"town": "Paris"}') + fmt.close)
    assert not check(ok + fmt.close + " and more text")


def test_required_named_and_single_call(grammars, bundled_tokenizer):
    call = HERMES.call_text("get_weather", PARIS)
    time = HERMES.call_text("get_time", "{}")
    both = call + "\n" + time
    required = tool_grammar(HERMES, [WEATHER, TIME], "required", parallel=True)
    named = tool_grammar(HERMES, [WEATHER, TIME], "named", parallel=True, named="get_time")
    single = tool_grammar(HERMES, [WEATHER, TIME], "required", parallel=False)
    check = lambda g, t: _accepts(grammars, bundled_tokenizer, g, t)
    assert check(required, call) and check(required, both)
    assert not check(required, "Text first. " + call) and not check(required, "")
    assert check(named, time) and not check(named, call) and not check(named, both)
    assert check(single, call) and not check(single, both)


def test_auto_with_a_text_schema_constrains_the_reply_without_calls(grammars,
                                                                    bundled_tokenizer):
    g = tool_grammar(HERMES, [WEATHER], "auto", parallel=True,
                     text_schema={"type": "object", "required": ["answer"],
                                  "properties": {"answer": {"type": "integer"}}})
    assert _accepts(grammars, bundled_tokenizer, g, json.dumps({"answer": 4}))
    assert _accepts(grammars, bundled_tokenizer, g, HERMES.call_text("get_weather", PARIS))
    assert not _accepts(grammars, bundled_tokenizer, g, "four")


def test_whitespace_in_arguments_is_bounded(grammars, bundled_tokenizer):
    from kvledger.engine.sample.structured.constraint import MAX_JSON_WHITESPACE

    g = tool_grammar(HERMES, [WEATHER], "required", parallel=False)
    pad = " " * MAX_JSON_WHITESPACE
    assert _accepts(grammars, bundled_tokenizer, g,
                    HERMES.call_text("get_weather", '{"city":' + pad + '"Paris"}'))
    assert not _accepts(grammars, bundled_tokenizer, g,
                        HERMES.call_text("get_weather", '{"city":' + pad + ' "Paris"}'))


class _Template:
    """A tokenizer whose template raises on roles other than user and assistant."""

    def apply_chat_template(self, messages, tokenize=False):
        if any(m["role"] not in ("user", "assistant") for m in messages):
            raise ValueError("roles must alternate user/assistant")
        return "".join(f"[{m['role']}] {m['content']}\n" for m in messages)


class _ChatML:
    def apply_chat_template(self, messages, tokenize=False):
        return "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in messages)


def test_tool_results_are_tool_turns_where_the_template_writes_them_else_named_user_turns():
    from kvledger.server.openai.protocol import ChatMessage
    from kvledger.server.tools.plan import template_messages

    history = [ChatMessage(role="user", content="Weather?"),
               ChatMessage(role="assistant", content=None, tool_calls=[{
                   "id": "c1", "function": {"name": "get_weather", "arguments": "{}"}}]),
               ChatMessage(role="tool", content="21 C", tool_call_id="c1")]
    chatml, _ = template_messages(history, None, _ChatML(), "m")
    assert chatml[2] == {"role": "tool", "content": "21 C"}
    strict, _ = template_messages(history, None, _Template(), "m")
    assert strict[2] == {"role": "user", "content": "get_weather returned: 21 C"}
