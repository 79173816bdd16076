"""The Responses API on the fake engine, through the official ``openai`` client."""

from __future__ import annotations

import base64
import threading

import openai
import pytest
from fake_engine import TEXT
from session_fakes import DEFAULT_SYSTEM, ChatFakeEngine, openai_client

from kvledger.sessions.service import SessionOptions

EVENT_ORDER = ["response.created", "response.in_progress", "response.output_item.added",
               "response.content_part.added"]
CLOSING = ["response.output_text.done", "response.content_part.done",
           "response.output_item.done", "response.completed"]


def _ids(text: str) -> list[int]:
    return [ord(c) for c in text]


def _stored(client, response_id: str, tenant: str = ""):
    return client.app.state.sessions.store.get_response(tenant, response_id)


def test_create_retrieve_delete(make_app):
    client = make_app()
    oc = openai_client(client)
    first = oc.responses.create(model="fake-model", input="hi", instructions="Be kind.")
    assert first.status == "completed" and first.output_text == TEXT
    prompt = "<|system|>Be kind.<|end|>\n<|user|>hi<|end|>\n<|assistant|>"
    assert first.usage.input_tokens == len(prompt)
    assert first.usage.output_tokens == len(TEXT)
    assert oc.responses.retrieve(first.id).output_text == TEXT
    oc.responses.delete(first.id)
    with pytest.raises(openai.NotFoundError):
        oc.responses.retrieve(first.id)
    with pytest.raises(openai.NotFoundError):
        oc.responses.create(input="again", previous_response_id=first.id)


def test_stream_event_types_in_order(make_app):
    oc = openai_client(make_app())
    events = list(oc.responses.create(input="hi", stream=True))
    kinds = [e.type for e in events]
    assert kinds[:4] == EVENT_ORDER and kinds[-4:] == CLOSING
    assert set(kinds[4:-4]) == {"response.output_text.delta"}
    assert "".join(e.delta for e in events[4:-4]) == TEXT
    assert [e.sequence_number for e in events] == list(range(len(events)))
    final = events[-1].response
    assert final.output_text == TEXT and final.usage.output_tokens == len(TEXT)
    assert oc.responses.retrieve(final.id).output_text == TEXT


def test_continuation_appends_the_new_turn_to_the_exact_ids(make_app):
    client = make_app()
    oc = openai_client(client)
    ids = []
    prev = None
    for n in range(4):
        r = oc.responses.create(input=f"turn {n}", previous_response_id=prev, extra_body={"memory": "full"})
        rec = _stored(client, r.id)
        prompt = rec.token_ids[: rec.prompt_len]
        if prev is None:
            assert prompt == _ids(DEFAULT_SYSTEM + "<|user|>turn 0<|end|>\n<|assistant|>")
        else:  # the whole previous conversation, then the reply's tail and the new turn
            assert prompt == ids + _ids(f"<|end|>\n<|user|>turn {n}<|end|>\n<|assistant|>")
        assert rec.token_ids[rec.prompt_len:] == _ids(TEXT)
        assert r.usage.input_tokens == rec.prompt_len
        ids, prev = rec.token_ids, r.id


def test_store_false_is_not_kept(make_app):
    oc = openai_client(make_app())
    r = oc.responses.create(input="hi", store=False)
    assert r.output_text == TEXT
    with pytest.raises(openai.NotFoundError):
        oc.responses.retrieve(r.id)


def test_sessions_are_per_api_key_and_salted(make_app):
    engine = ChatFakeEngine()
    client = make_app(engine, api_key=["key-a", "key-b"])
    a, b = openai_client(client, "key-a"), openai_client(client, "key-b")
    r = a.responses.create(input="secret")
    with pytest.raises(openai.NotFoundError):
        b.responses.retrieve(r.id)
    with pytest.raises(openai.NotFoundError):
        b.responses.create(input="x", previous_response_id=r.id)
    with pytest.raises(openai.NotFoundError):
        b.responses.delete(r.id)
    assert a.responses.retrieve(r.id).id == r.id
    rb = b.responses.create(input="secret")
    assert engine.salts[r.id] and engine.salts[rb.id] and engine.salts[r.id] != engine.salts[rb.id]
    with pytest.raises(openai.AuthenticationError):
        openai_client(client, "key-c").responses.create(input="x")
    listed = client.get("/v1/sessions", headers={"Authorization": "Bearer key-b"}).json()
    assert [s["id"] for s in listed["data"]] == [rb.id]


def test_disabled_truncation_refuses_with_the_numbers(make_app):
    client = make_app(ChatFakeEngine(max_model_len=160))
    oc = openai_client(client)
    r = oc.responses.create(input="hello", max_output_tokens=30)
    with pytest.raises(openai.BadRequestError) as err:
        oc.responses.create(input="more", previous_response_id=r.id, max_output_tokens=30)
    message = err.value.body["message"]
    need = _stored(client, r.id).token_ids.__len__() + len("<|end|>\n<|user|>more<|end|>\n"
                                                           "<|assistant|>")
    assert f"needs {need} prompt tokens" in message and "budget is 130 tokens" in message
    assert err.value.body["code"] == "context_length_exceeded"


def test_turn_bigger_than_the_budget_is_refused_even_with_auto(make_app):
    oc = openai_client(make_app(ChatFakeEngine(max_model_len=160)))
    with pytest.raises(openai.BadRequestError) as err:
        oc.responses.create(input="x" * 200, truncation="auto", max_output_tokens=30)
    assert "the new turn alone needs" in err.value.body["message"]
    assert "budget is 130 tokens" in err.value.body["message"]


def test_full_auto_slides_a_window(make_app):
    client = make_app(ChatFakeEngine(max_model_len=300))
    oc = openai_client(client)
    prev = None
    for n in range(6):
        r = oc.responses.create(input=f"turn {n}", previous_response_id=prev, extra_body={"memory": "full"},
                                truncation="auto", max_output_tokens=40)
        assert r.usage.input_tokens <= 260
        prev = r.id
    assert r.model_extra["kvledger"]["turns_in_prompt"] < 6


def test_restart_keeps_conversations(make_app, tmp_path):
    options = SessionOptions(state_db=str(tmp_path / "state.db"))
    first = make_app(sessions=options)
    r1 = openai_client(first).responses.create(input="hi", extra_body={"memory": "full"})
    ids = _stored(first, r1.id).token_ids
    first.__exit__(None, None, None)
    first.app.state.sessions.store.close()
    second = make_app(sessions=options)
    r2 = openai_client(second).responses.create(input="again", previous_response_id=r1.id,
                                                extra_body={"memory": "full"})
    rec = _stored(second, r2.id)
    assert rec.token_ids[: len(ids)] == ids and rec.session_id == r1.id
    assert second.app.state.sessions.store.journal_mode == "wal"


def test_concurrent_continuations_are_serialised(make_app):
    engine = ChatFakeEngine(step_delay_s=0.01)
    client = make_app(engine)
    oc = openai_client(client)
    r = oc.responses.create(input="hi")
    results = []

    def go(n):
        results.append(oc.responses.create(input=f"branch {n}", previous_response_id=r.id))

    threads = [threading.Thread(target=go, args=(n,)) for n in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(results) == 2 and engine.most_live == 1  # one turn at a time, none refused
    prompts = [_stored(client, x.id).token_ids for x in results]
    assert all(p[: len(_stored(client, r.id).token_ids)] == _stored(client, r.id).token_ids
               for p in prompts)  # both continue the same reply


def test_new_instructions_on_a_continuation_replace_the_system_turn(make_app):
    client = make_app()
    oc = openai_client(client)
    r = oc.responses.create(input="hi", instructions="Be kind.")
    r2 = oc.responses.create(input="again", instructions="Be brief.", previous_response_id=r.id)
    rec = _stored(client, r2.id)
    prompt = "".join(map(chr, rec.token_ids[: rec.prompt_len]))
    assert prompt == ("<|system|>Be brief.<|end|>\n<|user|>hi<|end|>\n<|assistant|>" + TEXT
                      + "<|end|>\n<|user|>again<|end|>\n<|assistant|>")
    r3 = oc.responses.create(input="more", previous_response_id=r2.id)  # None keeps them
    assert "".join(map(chr, _stored(client, r3.id).token_ids)).startswith(
        "<|system|>Be brief.")


def test_busy_conversation_gets_409(make_app):
    engine = ChatFakeEngine(step_delay_s=0.05)
    client = make_app(engine, sessions=SessionOptions(session_wait_s=0.2))
    oc = openai_client(client)
    r = oc.responses.create(input="hi", max_output_tokens=2)
    errors = []

    def go():
        try:
            oc.responses.create(input="slow", previous_response_id=r.id)
        except openai.APIStatusError as exc:
            errors.append(exc.status_code)

    threads = [threading.Thread(target=go) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == [409]


def _file(text: bytes, name: str = "doc.txt") -> dict:
    return {"type": "input_file", "filename": name,
            "file_data": base64.b64encode(text).decode()}


def _with_file(question: str, data: bytes) -> list[dict]:
    return [{"role": "user", "content": [{"type": "input_text", "text": question},
                                         _file(data)]}]


def test_bad_documents(make_app):
    oc = openai_client(make_app(sessions=SessionOptions(max_document_bytes=1000)))
    with pytest.raises(openai.BadRequestError) as err:
        oc.responses.create(input=_with_file("q", b"\x89PNG\r\n\x1a\n\x00\x00"))
    assert "not UTF-8 text" in err.value.body["message"]
    with pytest.raises(openai.APIStatusError) as err:
        oc.responses.create(input=_with_file("q", b"word " * 400))
    assert err.value.status_code == 413


def test_retrieval_stitches_the_chunk_with_the_fact(make_app):
    client = make_app()
    oc = openai_client(client)
    filler = [f"Section {i} talks about weather patterns, clouds and rain in region {i}."
              for i in range(30)]
    filler[17] = "The launch code of the orbital ferry is PELICAN-4471, kept by Marta Quist."
    document = "\n\n".join(" ".join([line] * 8) for line in filler).encode()
    r = oc.responses.create(input=_with_file("Hello, here is my document.", document))
    r2 = oc.responses.create(input="What is the launch code of the orbital ferry?",
                             previous_response_id=r.id)
    retrieved = r2.model_extra["kvledger"]["retrieved"]
    assert retrieved and "PELICAN-4471" in client.app.state.sessions.store.chunks(
        "", r.id)[[c.id for c in client.app.state.sessions.store.chunks("", r.id)].index(
            retrieved[0]["chunk_id"])].text
    rec = _stored(client, r2.id)
    prompt = "".join(map(chr, rec.token_ids[: rec.prompt_len]))
    new_turn = prompt[len("".join(map(chr, _stored(client, r.id).token_ids))):]
    assert "PELICAN-4471" in new_turn and "region 3 " not in new_turn


def test_metrics_count_session_turns(make_app):
    client = make_app()
    oc = openai_client(client)
    oc.responses.create(input="hi")
    text = client.get("/metrics").text
    assert 'kvledger:session_turns_total{model_name="fake-model"} 1.0' in text
    assert f'kvledger:session_output_tokens_total{{model_name="fake-model"}} {len(TEXT)}.0' in text


def test_chunks_without_terms_are_skipped_not_a_500():
    from kvledger.sessions.retrieval import Retriever
    from kvledger.sessions.store import Chunk

    chunks = [Chunk(1, "note", "note 1", ""), Chunk(2, "note", "note 2", "the of a")]
    assert Retriever().top_k(chunks, "what is the code", 2) == []
    chunks.append(Chunk(3, "document", "d", "the code is 4711"))
    assert [c.id for c, _ in Retriever().top_k(chunks, "what is the code", 2)] == [3]
