"""ToolCallParser: content and calls of a reply, the same whatever the text's split into
deltas, against an independent reading of the reply (a regex and ``json.loads``)."""

from __future__ import annotations

import json
import re

import pytest

from kvledger.server.tools.formats import HERMES, LLAMA3_JSON, MISTRAL
from kvledger.server.tools.parser import ToolCallParser

ARGS = ['{"city": "Paris", "note": "a } and a \\" inside"}', '{"ids": [1, {"x": []}]}']
HERMES_REPLY = ("Checking. " + HERMES.call_text("get_weather", ARGS[0]) + "\n"
                + HERMES.call_text("lookup", ARGS[1]))


def _hermes_oracle(text: str) -> tuple[str, list[tuple[str, dict]]]:
    blocks = re.findall(r"<tool_call>\n(.*?)\n</tool_call>", text, re.DOTALL)
    calls = [json.loads(b) for b in blocks]
    return text.split("<tool_call>")[0], [(c["name"], c["arguments"]) for c in calls]


def _run(parser: ToolCallParser, text: str, size: int) -> list[tuple]:
    events = []
    for i in range(0, len(text), size):
        events += parser.feed(text[i:i + size])
    return events + parser.finish()


@pytest.mark.parametrize("size", [1, 2, 3, 7, 1000])
def test_hermes_reply_in_any_split_matches_the_oracle(size):
    parser = ToolCallParser(HERMES)
    events = _run(parser, HERMES_REPLY, size)
    content, calls = _hermes_oracle(HERMES_REPLY)
    assert "".join(e[1] for e in events if e[0] == "content") == parser.content == content
    assert [(c.name, json.loads(c.arguments)) for c in parser.calls] == calls
    assert [c.arguments for c in parser.calls] == ARGS  # exactly as generated
    for i, call in enumerate(parser.calls):
        assert "".join(e[2] for e in events if e[0] == "arguments" and e[1] == i) == \
            call.arguments
    assert [e[0] for e in events if e[0] != "arguments"] == \
        (["content"] * (len([e for e in events if e[0] == "content"])) + ["call", "call"])


def test_text_that_only_looks_like_an_opening_stays_content():
    parser = ToolCallParser(HERMES)
    text = "a <tool_c or <tool_call without a newline"
    assert "".join(e[1] for e in _run(parser, text, 1)) == text and not parser.calls


def test_a_call_cut_by_max_tokens_is_not_complete():
    parser = ToolCallParser(HERMES)
    _run(parser, HERMES.call_text("f", '{"a": 1}')[:-20], 4)
    assert [c.complete for c in parser.calls] == [False]


@pytest.mark.parametrize("fmt, visible", [(LLAMA3_JSON, True), (MISTRAL, False),
                                          (MISTRAL, True)])
def test_llama_and_mistral_layouts(fmt, visible):
    first = (fmt.trigger if visible else "") + fmt.after_trigger
    text = first + "f" + fmt.args_key + ARGS[0] + fmt.tail + fmt.between + "g" + \
        fmt.args_key + ARGS[1] + fmt.tail + fmt.close
    parser = ToolCallParser(fmt, trigger_visible=visible)
    _run(parser, text, 3)
    assert [(c.name, c.arguments, c.complete) for c in parser.calls] == \
        [("f", ARGS[0], True), ("g", ARGS[1], True)]
    assert parser.content == ""
