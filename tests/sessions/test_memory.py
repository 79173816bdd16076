"""Memory policies on the fake engine: summary hysteresis and alignment, segments and notes."""

from __future__ import annotations

import itertools

from fake_engine import TEXT
from session_fakes import ChatFakeEngine, openai_client

from kvledger.sessions.memory import NOTES_HEADER, SUMMARY_HEADER
from kvledger.sessions.service import SessionOptions

MAX_OUT = 30


def _turns(client, n: int, policy: str, **extra):
    """Run n turns; yield (response, stored record) per turn."""
    oc = openai_client(client)
    prev = None
    for i in range(n):
        r = oc.responses.create(input=f"Turn number {i}: tell me something.", truncation="auto",
                                previous_response_id=prev, max_output_tokens=MAX_OUT,
                                extra_body={"memory": policy, **extra})
        yield r, client.app.state.sessions.store.get_response("", r.id)
        prev = r.id


def test_summary_stays_under_budget_and_appends_between_rewrites(make_app):
    engine = ChatFakeEngine(max_model_len=600)
    client = make_app(engine)
    budget = 600 - MAX_OUT
    previous, rewrite_turns = None, []
    for n, (r, rec) in enumerate(_turns(client, 40, "summary")):
        ext = r.model_extra["kvledger"]
        assert r.usage.input_tokens == rec.prompt_len <= budget
        prompt = rec.token_ids[: rec.prompt_len]
        if ext["memory_event"] == "summary":
            rewrite_turns.append(n)
            text = "".join(map(chr, prompt[: ext["prefix_tokens"]]))
            assert f"{SUMMARY_HEADER} {TEXT}" in text
        elif previous is not None:  # token-exact append: the whole previous conversation
            assert prompt[: len(previous.token_ids)] == previous.token_ids
        if ext["summary_rewrites"]:
            assert ext["prefix_tokens"] % 16 == 0  # system + summary fill whole blocks
        previous = rec
    assert len(rewrite_turns) >= 3
    gaps = [b - a for a, b in itertools.pairwise(rewrite_turns)]
    assert min(gaps) >= 2  # hysteresis: a rewrite frees room for several appends
    text = client.get("/metrics").text
    assert f'session_summary_rewrites_total{{model_name="fake-model"}} {len(rewrite_turns)}.0' \
        in text


def test_segments_write_notes_and_carry_them(make_app):
    client = make_app(ChatFakeEngine(), sessions=SessionOptions(segment_turns=3))
    records = list(_turns(client, 7, "segment"))
    events = [r.model_extra["kvledger"]["memory_event"] for r, _ in records]
    assert events == [None, None, None, "segment", None, None, "segment"]
    rec = records[3][1]
    prompt = "".join(map(chr, rec.token_ids[: rec.prompt_len]))
    assert prompt.startswith("<|system|>" + NOTES_HEADER + "\n- " + TEXT)
    assert prompt.rstrip().endswith("<|user|>Turn number 3: tell me something.<|end|>\n"
                                    "<|assistant|>".rstrip())
    notes = [c for c in client.app.state.sessions.store.chunks("", records[0][0].id)
             if c.kind == "note"]
    assert [n.text for n in notes] == [TEXT, TEXT]
    assert records[6][0].model_extra["kvledger"]["segment"] == 2
