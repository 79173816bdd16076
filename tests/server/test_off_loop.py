"""Work that grows with a request runs off the event loop, so ``/health`` and every stream keep
answering beside it (issue 61 item 8): a non-streamed response (prompt logprobs of a long
prompt made megabytes, 2.45 s on the loop), a chat request's tools turned into a prompt
(5,000 tools: 0.6-0.9 s), a ``/detokenize`` body (1.5 M ids: 0.37 s) and the grammar
tokenizer's set-up, done at start instead of beside the first structured request (0.4-1.0 s). Each test records on which thread the work ran; each
failed before the change. ``benchmarks/health_stalls.py`` measures the stalls themselves."""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading

from fake_engine import FakeEngine, FakeTokenizer

from kvledger.server.openai import routes


def _on_event_loop() -> bool:
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return False
    return True


class RecordingTokenizer(FakeTokenizer):
    """Notes whether each ``decode`` ran on an event loop's thread."""

    def __init__(self) -> None:
        self.on_loop: list[bool] = []

    def decode(self, ids: list[int]) -> str:
        self.on_loop.append(_on_event_loop())
        return super().decode(ids)


def test_a_response_is_built_and_serialised_off_the_event_loop(make_client, monkeypatch):
    engine = FakeEngine()
    engine.tokenizer = tokenizer = RecordingTokenizer()
    dumped: list[bool] = []
    render = routes.JSONResponse.render
    monkeypatch.setattr(routes.JSONResponse, "render",
                        lambda self, content: dumped.append(_on_event_loop())
                        or render(self, content))
    client = make_client(engine)
    r = client.post("/v1/completions", json={"prompt": "Hello there", "max_tokens": 2,
                                             "echo": True, "logprobs": 3, "prompt_logprobs": 3})
    assert r.status_code == 200, r.text
    assert len(r.json()["choices"][0]["prompt_logprobs"]) == len("Hello there")
    assert tokenizer.on_loop and not any(tokenizer.on_loop)
    assert dumped == [False]


def test_tools_are_turned_into_a_prompt_off_the_event_loop(make_client, monkeypatch):
    threads: list[bool] = []
    plan = routes.plan_tools
    monkeypatch.setattr(routes, "plan_tools",
                        lambda *args: threads.append(_on_event_loop()) or plan(*args))
    engine = FakeEngine()
    engine.max_model_len = 1 << 16
    tools = [{"type": "function", "function": {"name": f"f{i}", "parameters": {
        "type": "object", "properties": {"x": {"type": "integer"}}}}} for i in range(50)]
    r = make_client(engine).post("/v1/chat/completions", json={
        "messages": [{"role": "user", "content": "hi"}], "tools": tools, "tool_choice": "none",
        "max_tokens": 2})
    assert r.status_code == 200, r.text
    assert threads == [False]


class RecordingCompiler:
    """A GrammarCompiler stand-in: every constraint compiles at once; each one is kept."""

    def __init__(self) -> None:
        self.submitted: list = []

    def submit(self, constraint) -> concurrent.futures.Future:
        self.submitted.append((constraint, threading.current_thread().name))
        future: concurrent.futures.Future = concurrent.futures.Future()
        future.set_result(None)
        return future


def test_the_grammar_tokenizer_is_set_up_before_the_first_request(make_client):
    engine = FakeEngine()
    engine.grammars = compiler = RecordingCompiler()
    client = make_client(engine)
    assert [c for c, _ in compiler.submitted] == [routes.WARM_CONSTRAINT]
    assert client.get("/health").status_code == 200


def test_a_detokenize_body_is_parsed_off_the_event_loop(make_client, monkeypatch):
    """1.5 M ids took 0.37 s of JSON parsing and validation on the loop."""
    from kvledger.server.openai.protocol import DetokenizeRequest

    threads: list[bool] = []
    parse = DetokenizeRequest.model_validate_json
    monkeypatch.setattr(DetokenizeRequest, "model_validate_json",
                        lambda raw: threads.append(_on_event_loop()) or parse(raw))
    r = make_client().post("/detokenize", json={"tokens": [ord(c) for c in "Hi!"]})
    assert r.status_code == 200 and r.json() == {"prompt": "Hi!"}
    assert threads == [False]


def test_a_large_response_gives_the_heap_back_after_it(make_client, monkeypatch):
    """Prompt logprobs of a long prompt left RSS 1.7 GB higher for good (issue 61 item 9):
    after a body of a megabyte or more the freed heap goes back to the OS (glibc)."""
    from kvledger.server import heap_trim

    trimmed: list[int] = []
    monkeypatch.setattr(heap_trim, "TRIM_FROM_BYTES", 2000)
    monkeypatch.setattr(heap_trim, "_malloc_trim", lambda: trimmed.append)
    client = make_client()
    assert client.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 1}).status_code == 200
    assert trimmed == []
    r = client.post("/v1/completions", json={"prompt": "Hello there " * 4, "max_tokens": 1,
                                             "prompt_logprobs": 5})
    assert r.status_code == 200 and len(r.content) >= 2000
    assert trimmed == [0]


def test_a_detokenize_answer_is_decoded_and_serialised_off_the_event_loop(make_client,
                                                                         monkeypatch):
    """Old code: the decoded text (10 MB for 1.5 M ids) was serialised on the loop."""
    from kvledger.server import vllm_compat

    threads: list[bool] = []
    made = vllm_compat._detokenized
    monkeypatch.setattr(vllm_compat, "_detokenized",
                        lambda tok, ids: threads.append(_on_event_loop()) or made(tok, ids))
    r = make_client().post("/detokenize", json={"tokens": [ord(c) for c in "Hi!"]})
    assert r.status_code == 200 and r.json() == {"prompt": "Hi!"}
    assert threads == [False]


def test_decode_releases_the_gil_through_decode_batch_and_gives_the_same_text(
        bundled_tokenizer, monkeypatch):
    """The fast tokenizer's ``decode`` holds the GIL for its whole run (old code: the event
    loop stood still while 1.5 M ids were decoded); ``decode_batch`` releases it."""
    from kvledger.server.tokenizer_thread import decode

    text = "Grüße, 世界! <|im_start|>assistant\n  spaced  \ttabs 🙂"
    ids = bundled_tokenizer.encode(text) + [0, 1, 2]  # special tokens too
    backend = bundled_tokenizer.backend_tokenizer
    calls: list[int] = []
    batch = type(backend).decode_batch
    monkeypatch.setattr(type(backend), "decode_batch",
                        lambda self, seqs, **kw: calls.append(len(seqs)) or batch(self, seqs, **kw),
                        raising=False)
    assert decode(bundled_tokenizer, ids) == bundled_tokenizer.decode(ids)
    assert calls == [1]


def test_the_heap_is_trimmed_periodically_between_steps(make_client, monkeypatch):
    """Issue 61 item 11: free heap piled up over minutes of steps (RSS +30 MiB a minute, given
    back by malloc_trim); old code trimmed only after large responses."""
    from kvledger.server import heap_trim

    clock = [0.0]
    trims: list[int] = []
    monkeypatch.setattr(heap_trim, "_malloc_trim", lambda: trims.append)
    periodic = heap_trim.PeriodicTrim(30.0, now=lambda: clock[0])
    assert not periodic.maybe_trim() and trims == []
    clock[0] = 29.9
    assert not periodic.maybe_trim()
    clock[0] = 30.0
    assert periodic.maybe_trim() and trims == [0]
    assert not periodic.maybe_trim()  # the next one 30 s later
    clock[0] = 60.0
    assert periodic.maybe_trim() and trims == [0, 0]

    monkeypatch.setattr(heap_trim, "TRIM_EVERY_S", 0.0)  # the server's loop: every step
    client = make_client()
    assert client.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 3}).status_code \
        == 200
    assert len(trims) >= 3 + 2  # one per step of that request
