"""Retrieval stitches a passage only for terms the prompt does not already hold.

The turns are the bench's filler messages (``Turn i. In one sentence, what is this passage
about? ...``); the old note shares their template words. Stitching on any positive BM25 score
put that note into every turn, which made the ``segment`` policy close a segment every turn.
"""

from __future__ import annotations

from session_fakes import openai_client

from kvledger.bench.responses_chat import filler

NOTE = ("Turn 2 asked what a passage about bees is about, in one sentence: the bee keeper "
        "of the valley is Olga Brandt.")


def _continue(oc, text, previous):
    r = oc.responses.create(input=text, previous_response_id=previous, max_output_tokens=20,
                            truncation="auto", extra_body={"memory": "full"})
    return r, r.model_extra["kvledger"]["retrieved"]


def test_template_words_do_not_stitch_an_old_note_but_its_facts_do(make_app):
    client = make_app()
    oc = openai_client(client)
    first, retrieved = _continue(oc, filler(1, 32), None)
    assert retrieved == []
    # a note of an earlier segment, no longer carried in the prompt
    client.app.state.sessions.store.add_chunks("", first.id, "note", "note 1", [NOTE])
    previous = first.id
    for i in range(2, 8):
        r, retrieved = _continue(oc, filler(i, 32), previous)
        assert retrieved == [], f"turn {i} stitched the note on template words only"
        previous = r.id
    r, retrieved = _continue(oc, "Who is the bee keeper of the valley?", previous)
    assert [x["source"] for x in retrieved] == ["note 1"]
    stored = client.app.state.sessions.store.get_response("", r.id)
    assert "Olga Brandt" in "".join(map(chr, stored.token_ids[: stored.prompt_len]))
