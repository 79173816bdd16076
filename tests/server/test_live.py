"""A live ``kvledger serve`` (bundled SmolLM2-135M-Instruct) driven by the official ``openai``
client and raw HTTP: parity of streamed and whole answers, usage, errors under load, disconnect
aborts, 64 concurrent requests, batching of concurrent streams, and a bounded schemathesis run.

Expected values come from the OpenAI API contract and the model card (context 8192 tokens).
Polls use deadlines as timeouts only; no test asserts a duration.
"""

from __future__ import annotations

import asyncio
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest
from live_server import API_KEY, KV_QUOTA_TOKENS

pytestmark = pytest.mark.slow

CONTEXT = 8192  # SmolLM2-135M-Instruct model card: 8k context
QUESTION = [{"role": "user", "content": "Name three colors."}]


@pytest.fixture(scope="module")
def server(live_server):
    return live_server


@pytest.fixture(scope="module")
def client(server):
    from openai import OpenAI

    return OpenAI(base_url=server.url + "/v1", api_key=API_KEY, max_retries=0)


def _wait_idle(server, idle: dict, timeout_s: float = 30.0) -> tuple[dict, float]:
    """Poll /metrics until nothing runs and KV usage is back to ``idle``; (metrics, seconds)."""
    start = time.monotonic()
    while True:
        m = server.metrics()
        if (m["num_requests_running"] == 0 and m["num_requests_waiting"] == 0
                and m["kv_cache_usage_perc"] == idle["kv_cache_usage_perc"]
                and m["kv_bytes_allocated"] == idle["kv_bytes_allocated"]):
            return m, time.monotonic() - start
        assert time.monotonic() - start < timeout_s, f"server not idle: {m}"
        time.sleep(0.02)


def test_models_list_the_context_limit(client):
    (card,) = client.models.list().data
    assert card.model_extra["max_model_len"] == CONTEXT


def test_chat_streamed_text_equals_whole_text_at_temperature_0(client):
    args = {"model": client.models.list().data[0].id, "messages": QUESTION, "max_tokens": 24,
            "temperature": 0}
    whole = client.chat.completions.create(**args)
    chunks = list(client.chat.completions.create(**args, stream=True))
    assert chunks[0].choices[0].delta.role == "assistant"
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert streamed == whole.choices[0].message.content and streamed
    assert chunks[-1].choices[0].finish_reason == whole.choices[0].finish_reason


def test_completion_streamed_text_equals_whole_text_at_temperature_0(client):
    args = {"model": client.models.list().data[0].id, "prompt": "The sky is", "max_tokens": 16,
            "temperature": 0}
    whole = client.completions.create(**args)
    streamed = "".join(c.choices[0].text for c in client.completions.create(**args, stream=True))
    assert streamed == whole.choices[0].text and streamed
    assert whole.usage.completion_tokens <= 16


def test_include_usage_gives_one_usage_chunk_counting_the_streamed_tokens(client):
    chunks = list(client.chat.completions.create(
        model=client.models.list().data[0].id, messages=QUESTION, max_tokens=12, stream=True,
        logprobs=True, temperature=0, stream_options={"include_usage": True},
        extra_body={"ignore_eos": True}))
    with_usage = [c for c in chunks if c.usage is not None]
    assert len(with_usage) == 1 and with_usage[0] is chunks[-1] and chunks[-1].choices == []
    streamed_tokens = sum(len(c.choices[0].logprobs.content) for c in chunks[:-1]
                          if c.choices and c.choices[0].logprobs)
    assert streamed_tokens == with_usage[0].usage.completion_tokens == 12


def test_two_concurrent_streams_progress_together(server):
    order, lock = [], threading.Lock()

    def stream(name: str) -> None:
        body = {"prompt": "Count: one, two,", "max_tokens": 24, "ignore_eos": True,
                "temperature": 0, "stream": True}
        with httpx.stream("POST", server.url + "/v1/completions", json=body,
                          headers=server.headers, timeout=120) as resp:
            for line in resp.iter_lines():
                if line.startswith("data: {"):
                    with lock:
                        order.append(name)

    threads = [threading.Thread(target=stream, args=(n,)) for n in "ab"]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    # a token whose text is not complete yet (a partial UTF-8 character) sends no event, so
    # count events loosely; greedy text here is plain ASCII, one event per token in practice
    assert 12 <= order.count("a") == order.count("b") <= 24
    # each stream got tokens before the other one finished: they shared engine steps
    assert order.index("b") < len(order) - 1 - order[::-1].index("a")
    assert order.index("a") < len(order) - 1 - order[::-1].index("b")


def _bad_requests(server, model: str) -> list[tuple[str, dict, object, int, str | None]]:
    """(what, headers, body, status, error code) for every malformed request of the issue."""
    key, json_ct = server.headers, {**server.headers, "content-type": "application/json"}
    chat = {"model": model, "messages": QUESTION}
    long_prompt = "hello " * 9000
    return [
        ("malformed JSON", json_ct, b'{"model": ', 400, None),
        ("missing messages", key, {"model": model}, 400, None),
        ("negative max_tokens", key, {**chat, "max_tokens": -5}, 400, None),
        ("prompt over the context", key, {"model": model, "prompt": long_prompt}, 400,
         "context_length_exceeded"),
        ("prompt + max_tokens over the context", key, {**chat, "max_tokens": CONTEXT}, 400,
         "context_length_exceeded"),
        ("unknown model", key, {**chat, "model": "gpt-17"}, 404, "model_not_found"),
        ("missing key", {}, chat, 401, "invalid_api_key"),
        ("wrong key", {"Authorization": "Bearer nope"}, chat, 401, "invalid_api_key"),
        ("10 MB body", json_ct, b'{"prompt": "' + b"a" * (10 << 20) + b'"}', 413,
         "request_too_large"),
        ("KV over the per-request quota", key, {**chat, "max_tokens": KV_QUOTA_TOKENS}, 400,
         "kv_quota_exceeded"),
    ]


def test_bad_inputs_get_openai_errors_while_a_normal_request_succeeds(server, client):
    model = client.models.list().data[0].id
    started, result = threading.Event(), {}

    def normal() -> None:
        chunks = []
        for chunk in client.completions.create(model=model, prompt="Once upon a time",
                                               max_tokens=48, stream=True,
                                               extra_body={"ignore_eos": True}):
            started.set()
            chunks.append(chunk)
        result["chunks"] = chunks

    runner = threading.Thread(target=normal)
    runner.start()
    assert started.wait(60)
    for what, headers, body, status, code in _bad_requests(server, model):
        path = "/v1/completions" if isinstance(body, bytes) or "prompt" in body else \
            "/v1/chat/completions"
        kwargs = {"content": body} if isinstance(body, bytes) else {"json": body}
        resp = httpx.post(server.url + path, headers=headers, timeout=60, **kwargs)
        assert resp.status_code == status, (what, resp.text)
        err = resp.json()["error"]
        assert set(err) == {"message", "type", "param", "code"}, what
        assert code is None or err["code"] == code, (what, err)
        if status == 429:
            assert resp.headers["retry-after"], what
        if code == "context_length_exceeded":
            assert str(CONTEXT) in err["message"], err
    runner.join()
    assert result["chunks"][-1].choices[0].finish_reason == "length"
    assert "".join(c.choices[0].text for c in result["chunks"])


def test_context_error_names_the_limit_prompt_tokens_and_max_tokens(server):
    prompt = "one two three"
    n_prompt = httpx.post(server.url + "/tokenize", json={"prompt": prompt},
                          headers=server.headers).json()["count"]
    resp = httpx.post(server.url + "/v1/completions", headers=server.headers,
                      json={"prompt": prompt, "max_tokens": CONTEXT})
    message = resp.json()["error"]["message"]
    assert resp.status_code == 400
    assert str(CONTEXT) in message and f"{n_prompt} tokens" in message
    assert f"max_tokens is {CONTEXT}" in message


def test_disconnect_mid_stream_frees_the_request(server):
    idle, _ = _wait_idle(server, {"kv_cache_usage_perc": 0.0, "kv_bytes_allocated": 0.0})
    body = {"prompt": "Once upon a time", "max_tokens": 100, "ignore_eos": True,
            "stream": True}
    with httpx.stream("POST", server.url + "/v1/completions", json=body,
                      headers=server.headers, timeout=60) as resp:
        lines = resp.iter_lines()
        assert sum(1 for line, _ in zip(lines, range(4)) if line.startswith("data: {")) >= 2
        assert server.metrics()["num_requests_running"] == 1
    after, seconds = _wait_idle(server, idle)
    print(f"idle {seconds:.3f} s after the stream's disconnect")
    assert after.get("request_success_total:abort", 0) == idle.get(
        "request_success_total:abort", 0) + 1


def test_disconnect_mid_non_stream_frees_the_request(server):
    idle, _ = _wait_idle(server, {"kv_cache_usage_perc": 0.0, "kv_bytes_allocated": 0.0})
    body = {"prompt": "Once upon a time", "max_tokens": 120, "ignore_eos": True}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(server.url + "/v1/completions", json=body, headers=server.headers,
                   timeout=httpx.Timeout(60, read=0.5))
    after, seconds = _wait_idle(server, idle)
    print(f"idle {seconds:.3f} s after the non-streamed request's disconnect")
    assert after.get("request_success_total:abort", 0) == idle.get(
        "request_success_total:abort", 0) + 1


def test_64_concurrent_requests_complete_and_leak_no_block(server):
    from openai import AsyncOpenAI

    model = httpx.get(server.url + "/v1/models", headers=server.headers).json()["data"][0]["id"]

    async def run() -> list:
        async with AsyncOpenAI(base_url=server.url + "/v1", api_key=API_KEY,
                               max_retries=0, timeout=300) as aclient:
            return await asyncio.gather(*(aclient.completions.create(
                model=model, prompt=f"Fact number {i}:", max_tokens=8,
                extra_body={"ignore_eos": True}) for i in range(64)))

    results = asyncio.run(run())
    assert [r.usage.completion_tokens for r in results] == [8] * 64
    assert {r.choices[0].finish_reason for r in results} == {"length"}
    m, _ = _wait_idle(server, {"kv_cache_usage_perc": 0.0, "kv_bytes_allocated": 0.0})
    assert m["kv_bytes_predicted"] == 0


def test_metrics_and_logs_report_requests(server):
    prompt = "One, two, three,"
    n_prompt = httpx.post(server.url + "/tokenize", json={"prompt": prompt},
                          headers=server.headers).json()["count"]
    over_alert = {"prompt": prompt, "max_tokens": 40 - n_prompt, "ignore_eos": True}
    assert httpx.post(server.url + "/v1/completions", json=over_alert, headers=server.headers,
                      timeout=120).status_code == 200  # 40 tokens: 3 blocks > KV_ALERT_BYTES
    over_quota = {"prompt": prompt, "max_tokens": KV_QUOTA_TOKENS}
    assert httpx.post(server.url + "/v1/completions", json=over_quota,
                      headers=server.headers).status_code == 400
    m = server.metrics()
    for name in ("time_to_first_token_seconds_count", "inter_token_latency_seconds_count",
                 "e2e_request_latency_seconds_count", "request_queue_time_seconds_count",
                 "request_kv_bytes_count", "prompt_tokens_total", "generation_tokens_total",
                 "prefix_cache_queries_total", "kv_alerts_total", "kv_quota_rejections_total"):
        assert m[name] > 0, name
    log = server.log_text()
    assert "request finished id=" in log and "peak_kv_bytes=" in log
    assert "kv_alert request_id=" in log and "engine running=" in log


def test_schemathesis_finds_no_server_error(server, tmp_path):
    cmd = [str(Path(sys.executable).parent / "schemathesis"), "run", server.url + "/openapi.json",
           "-H", f"Authorization: Bearer {API_KEY}", "--checks", "not_a_server_error",
           "--phases", "examples,fuzzing", "-n", "30", "--max-time", "30", "--workers", "2",
           "--seed", "7", "--request-timeout", "60", "--no-shrink"]
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=tmp_path,
                         check=False)
    print(run.stdout[-1500:])
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-2000:]
    log = server.log_text()
    assert "unhandled error" not in log and "engine step failed" not in log


def test_logit_bias_forces_a_token_and_out_of_vocabulary_ids_are_400(server):
    body = {"prompt": "Hello", "max_tokens": 3, "temperature": 0, "ignore_eos": True,
            "logit_bias": {"28": 100}}
    resp = httpx.post(server.url + "/v1/completions", json=body, headers=server.headers,
                      timeout=120)
    text = resp.json()["choices"][0]["text"]
    assert resp.status_code == 200 and text and text == text[:len(text) // 3] * 3
    plain = httpx.post(server.url + "/v1/completions", json={**body, "logit_bias": {}},
                       headers=server.headers, timeout=120).json()["choices"][0]["text"]
    assert plain != text
    bad = httpx.post(server.url + "/v1/completions", json={**body, "logit_bias": {"99999999": 1}},
                     headers=server.headers, timeout=60)
    assert bad.status_code == 400 and "vocabulary" in bad.json()["error"]["message"]
