"""Prompts cut to exact token counts (with an independent word-count tokenizer)."""

from __future__ import annotations

import pytest

from kvledger.bench.prompts import TokenCounter, corpus, cut_to_tokens, make_prompt


class Words(TokenCounter):
    """One token per whitespace-separated word: counts are obvious by hand."""

    exact = True

    def count(self, text: str) -> int:
        return len(text.split())


def test_cut_by_hand():
    source = "alpha beta gamma delta epsilon"
    text, n = cut_to_tokens(Words(), source, 3)
    assert n == 3 and Words().count(text) == 3 and source.startswith(text)
    assert text.split()[:2] == ["alpha", "beta"]


def test_text_shorter_than_asked_is_returned_whole():
    assert cut_to_tokens(Words(), "one two", 5) == ("one two", 2)


@pytest.mark.parametrize("n", [1, 7, 100, 2048, 9000])
def test_make_prompt_hits_the_exact_count(n):
    text, count = make_prompt(Words(), f"uid-{n}", n)
    assert count == n and len(text.split()) == n


def test_prompts_are_real_text_and_distinct_per_uid():
    a, _ = make_prompt(Words(), "a", 200)
    b, _ = make_prompt(Words(), "b", 200)
    assert a.split()[:2] != b.split()[:2]  # different header: no shared KV block
    assert a.split("\n", 1)[1][:200] in corpus() + "\n\n" + corpus()[:1000]


def test_estimate_counter_is_four_characters_per_token():
    assert TokenCounter().count("x" * 400) == 100
    assert not TokenCounter().exact


def test_probe_skips_llama_cpp_empty_answer_to_the_unknown_key():
    # llama.cpp's server ignores {"prompt"} and answers {"tokens": []}: before the fix the
    # probe took it, every count was 0 and the bench built an 8-million-token prompt
    import httpx
    from fake_sse import FakeServer

    from kvledger.bench.prompts import ServerTokenizer
    from kvledger.bench.target import Target

    with FakeServer(tokenize="llama.cpp") as server, httpx.Client() as client:
        target = Target.from_url(server.url)
        tokenizer = ServerTokenizer.probe(client, target)
        assert tokenizer is not None and tokenizer.body_key == "content"
        assert tokenizer.count("one two three") == 3


def test_probe_refuses_a_server_whose_counts_are_implausible(monkeypatch):
    import httpx

    from kvledger.bench.prompts import ServerTokenizer
    from kvledger.bench.target import Target

    def answer(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, json={"count": 0, "tokens": []})

    with httpx.Client(transport=httpx.MockTransport(answer)) as client:
        assert ServerTokenizer.probe(client, Target.from_url("http://127.0.0.1:9")) is None
