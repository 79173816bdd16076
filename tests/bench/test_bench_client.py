"""Timing a stream against the scripted server (fake_sse.py): what counts as content.

Durations asserted here are properties of the fake server's script (its sleeps), not timings of
our code: the role-only chunk is followed by 300 ms of silence, so a TTFT below 250 ms would
mean the role chunk was taken for content.
"""

from __future__ import annotations

import asyncio

import httpx
import pytest

from kvledger.bench.client import StreamResult, stream_request, tpot
from kvledger.bench.target import Target


def run(server, script: str, endpoint: str = "chat", max_tokens: int = 4) -> StreamResult:
    target = Target.from_url(server.url + "/v1", endpoint=endpoint)
    target.model = script

    async def go():
        async with httpx.AsyncClient(timeout=10) as client:
            return await stream_request(client, target.generate_url,
                                        target.payload("hi", max_tokens), target.headers)

    return asyncio.run(go())


@pytest.mark.parametrize("endpoint", ["chat", "completions"])
def test_role_only_chunk_is_not_the_first_token(fake_server, endpoint):
    r = run(fake_server, "role-pause", endpoint)
    assert r.ok, r.error
    assert r.ttft_s >= 0.25  # the script waits 300 ms after the role chunk
    assert r.content_events == 4
    assert r.output_tokens == 4 and r.prompt_tokens == 7  # from the usage chunk
    assert r.text == "Hello there dear user"
    assert len(r.itl_s) == 3
    # E2E runs to the last byte: the usage chunk and [DONE] come after the last content
    assert r.e2e_s >= r.ttft_s + sum(r.itl_s)


def test_done_only_is_a_failure_not_a_zero(fake_server):
    r = run(fake_server, "done-only")
    assert not r.ok
    assert "no generated content" in r.error
    assert r.ttft_s is None and r.e2e_s is None and r.tpot_s is None


def test_http_error_is_a_failure(fake_server):
    r = run(fake_server, "http-500")
    assert not r.ok and r.error.startswith("HTTP 500")


def test_multi_token_chunks_make_itl_and_tpot_differ(fake_server):
    r = run(fake_server, "multi-token", max_tokens=6)
    assert r.ok and r.content_events == 3 and r.output_tokens == 6
    # 3 events -> 2 ITL gaps; 6 tokens -> TPOT spreads E2E - TTFT over 5 token gaps
    assert len(r.itl_s) == 2
    assert r.tpot_s * 5 == pytest.approx(r.e2e_s - r.ttft_s)
    assert r.tpot_s * 5 == pytest.approx(sum(r.itl_s), abs=0.02)  # + the usage/[DONE] write
    # so the mean ITL is (E2E - TTFT) / 2 = 2.5 x TPOT: per event, not per token
    assert sum(r.itl_s) / len(r.itl_s) == pytest.approx(2.5 * r.tpot_s, rel=0.05)


def test_e2e_runs_to_the_last_byte_not_the_last_content(fake_server):
    r = run(fake_server, "late-done", "completions", max_tokens=2)
    assert r.ok
    assert r.e2e_s - (r.ttft_s + sum(r.itl_s)) >= 0.25  # the script's 300 ms before [DONE]


def test_tokens_of_the_first_event_are_not_divided_into_tpot(fake_server):
    # the first content event brings 3 of 6 tokens: TPOT spreads E2E - TTFT over 3, not 5
    r = run(fake_server, "continuous-usage", max_tokens=6)
    assert r.ok and r.first_event_tokens == 3 and r.output_tokens == 6
    assert r.tpot_s == pytest.approx((r.e2e_s - r.ttft_s) / 3)


def test_comments_crlf_and_a_json_event_split_across_writes(fake_server):
    r = run(fake_server, "split", max_tokens=3)
    assert r.ok, r.error
    assert r.text == "split ok!"
    assert r.content_events == 3 and r.output_tokens == 3
    assert not r.notes


def test_missing_usage_falls_back_to_counting_events_with_a_note(fake_server):
    r = run(fake_server, "no-usage", max_tokens=3)
    assert r.ok and r.output_tokens == 3
    assert any("no usage chunk" in n for n in r.notes)


def test_unreachable_server_is_a_failure():
    async def go():
        async with httpx.AsyncClient(timeout=2) as client:
            return await stream_request(client, "http://127.0.0.1:9/v1/completions", {})

    r = asyncio.run(go())
    assert not r.ok and r.error


def test_tpot_hand_computed():
    # TTFT 0.5 s, E2E 2.5 s, 11 output tokens: (2.5 - 0.5) / 10 = 0.2 s
    assert tpot(0.5, 2.5, 11) == pytest.approx(0.2)
    assert tpot(0.5, 0.5, 1) is None  # one token: no gap to divide
    assert tpot(None, 2.5, 11) is None
    assert tpot(0.5, 2.5, 11, first_tokens=3) == pytest.approx(0.25)  # 2 s over 8 tokens
    assert tpot(0.5, 2.5, 3, first_tokens=3) is None
