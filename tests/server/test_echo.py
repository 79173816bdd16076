"""``/v1/completions`` with ``echo``, ``max_tokens: 0`` and ``prompt_logprobs``, in vLLM's
shape (``entrypoints/openai/serving_completion.py``: the prompt first, its first token's
logprob null), and the bad combinations refused with a 400 that names them.

The fake engine's tokens are characters and its prompt logprobs are fixed (token i: -i / 10);
the live test compares the bundled model's values with transformers on the same GGUF (fp32).
"""

from __future__ import annotations

import httpx
import pytest
import torch
from fake_engine import TEXT


def _post(client, **body):
    return client.post("/v1/completions", json=body)


def test_echo_puts_the_prompt_and_its_logprobs_first(make_client):
    r = _post(make_client(), prompt="Hey", max_tokens=3, echo=True, logprobs=2)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert choice["text"] == "Hey" + TEXT[:3]
    lp = choice["logprobs"]
    assert lp["tokens"] == ["H", "e", "y", *TEXT[:3]]
    assert lp["token_logprobs"][:3] == [None, -0.1, -0.2]
    assert lp["top_logprobs"][0] is None and lp["top_logprobs"][1] == {"?": -0.05, "!": -0.07}
    assert lp["text_offset"] == [0, 1, 2, 3, 4, 5]
    assert "prompt_logprobs" not in choice  # only when asked by name
    assert r.json()["usage"]["completion_tokens"] == 3


def test_max_tokens_0_with_echo_returns_the_prompt_alone(make_client):
    r = _post(make_client(), prompt="Hey", max_tokens=0, echo=True, logprobs=1)
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["choices"][0]["text"] == "Hey"
    assert body["choices"][0]["logprobs"]["tokens"] == ["H", "e", "y"]
    assert body["usage"]["completion_tokens"] == 0 and body["usage"]["total_tokens"] == 3


def test_prompt_logprobs_field_in_vllms_shape(make_client):
    r = _post(make_client(), prompt="Hi!", max_tokens=1, prompt_logprobs=1)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert choice["text"] == TEXT[:1] and choice["logprobs"] is None
    assert choice["prompt_logprobs"] == [
        None,
        {str(ord("i")): {"logprob": -0.1, "rank": 1, "decoded_token": "i"},
         str(ord("?")): {"logprob": -0.05, "rank": 1, "decoded_token": "?"}},
        {str(ord("!")): {"logprob": -0.2, "rank": 2, "decoded_token": "!"},
         str(ord("?")): {"logprob": -0.05, "rank": 1, "decoded_token": "?"}},
    ]


def test_a_batch_of_token_id_prompts_echoes_each_one(make_client):
    # lm-eval's local-completions: token ids, echo, logprobs 1, max_tokens 1, several prompts
    prompts = [[ord(c) for c in "ab"], [ord(c) for c in "xyz"]]
    r = _post(make_client(), prompt=prompts, max_tokens=1, echo=True, logprobs=1,
              temperature=0)
    assert r.status_code == 200, r.text
    body = r.json()
    texts = [c["text"] for c in sorted(body["choices"], key=lambda c: c["index"])]
    assert texts == ["ab" + TEXT[0], "xyz" + TEXT[0]]
    assert body["usage"]["prompt_tokens"] == 5 and body["usage"]["completion_tokens"] == 2


def test_chat_prompt_logprobs_are_the_responses_top_level_field(make_client):
    """vLLM's chat response carries ``prompt_logprobs`` over the rendered prompt (issue 61
    item 10: it was dropped as an unknown field)."""
    client = make_client()
    messages = [{"role": "user", "content": "Hey"}]
    r = client.post("/v1/chat/completions", json={"messages": messages, "max_tokens": 1,
                                                  "prompt_logprobs": 1})
    assert r.status_code == 200, r.text
    body, ids = r.json(), client.post("/tokenize", json={"messages": messages}).json()["tokens"]
    entries = body["prompt_logprobs"]
    assert len(entries) == len(ids) == body["usage"]["prompt_tokens"] and entries[0] is None
    assert entries[1] == {
        str(ids[1]): {"logprob": -0.1, "rank": 1, "decoded_token": chr(ids[1])},
        str(ord("?")): {"logprob": -0.05, "rank": 1, "decoded_token": "?"}}
    assert "prompt_logprobs" not in body["choices"][0]
    plain = client.post("/v1/chat/completions", json={"messages": messages, "max_tokens": 1})
    assert "prompt_logprobs" not in plain.json()
    streamed = client.post("/v1/chat/completions", json={
        "messages": messages, "prompt_logprobs": 1, "stream": True})
    assert streamed.status_code == 400
    assert "'prompt_logprobs' with 'stream'" in streamed.json()["error"]["message"]


@pytest.mark.parametrize("route", ["/v1/completions", "/v1/chat/completions"])
def test_prompt_logprob_entries_are_capped_by_an_option(make_client, route):
    """Tokens x (prompt_logprobs + 1) over --max-prompt-logprob-entries: a 400 naming it
    (issue 61 item 9); at the cap the request is served."""
    from kvledger.server.limits.server_limits import ServerLimits

    client = make_client(limits=ServerLimits(max_prompt_logprob_entries=60))
    text = "x" * 20
    body = ({"prompt": text} if route == "/v1/completions"
            else {"messages": [{"role": "user", "content": text}]})
    tokens = len(text) if route == "/v1/completions" else client.post(
        "/tokenize", json={"messages": body["messages"]}).json()["count"]
    over = client.post(route, json={**body, "max_tokens": 1,
                                    "prompt_logprobs": 60 // tokens})
    assert over.status_code == 400, over.text
    error = over.json()["error"]
    assert error["param"] == "prompt_logprobs" and "--max-prompt-logprob-entries" in (
        error["message"])
    k = 60 // tokens - 1
    if route == "/v1/completions":  # echo with logprobs N counts N
        echo = client.post(route, json={**body, "max_tokens": 1, "echo": True,
                                        "logprobs": k + 1})
        assert echo.status_code == 400, echo.text
    assert client.post(route, json={**body, "max_tokens": 1,
                                    "prompt_logprobs": k}).status_code == 200
    if route == "/v1/completions":  # the cap is per request: a batch's prompts add up
        batch = client.post(route, json={"prompt": [text, text], "max_tokens": 1,
                                         "prompt_logprobs": k})
        assert batch.status_code == 400, batch.text


@pytest.mark.parametrize(("body", "named"), [
    ({"echo": True, "stream": True}, "'echo' with 'stream'"),
    ({"prompt_logprobs": 1, "stream": True}, "'prompt_logprobs' with 'stream'"),
    ({"max_tokens": 0}, "'max_tokens' must be >= 1 unless 'echo' is true"),
    ({"echo": True, "logprobs": 21}, "'logprobs' must be <= 20"),
    ({"prompt_logprobs": 21}, "'prompt_logprobs' must be <= 20"),
    ({"echo": True, "n": 2}, "'n' must be <= 1"),
])
def test_bad_combinations_are_400s_naming_them(make_client, body, named):
    r = _post(make_client(), prompt="Hey", **body)
    assert r.status_code == 400 and named in r.json()["error"]["message"], r.text


@pytest.mark.slow
def test_live_echo_logprobs_match_transformers(live_server):
    """The server's fp32 prompt logprobs equal transformers' log-softmax on the same GGUF."""
    from transformers import AutoModelForCausalLM

    from kvledger.paths import bundled_model_path

    url, headers = live_server.url, live_server.headers
    text = "Question: What is the capital of France?\nAnswer: Paris"
    ids = httpx.post(url + "/tokenize", headers=headers, json={"prompt": text}).json()["tokens"]
    r = httpx.post(url + "/v1/completions", headers=headers, timeout=60, json={
        "prompt": ids, "max_tokens": 0, "echo": True, "logprobs": 1, "temperature": 0})
    assert r.status_code == 200, r.text
    got = r.json()["choices"][0]["logprobs"]["token_logprobs"]
    path = bundled_model_path()
    hf = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name,
                                              dtype=torch.float32).eval()
    with torch.no_grad():
        logp = torch.log_softmax(hf(torch.tensor([ids])).logits[0].float(), dim=-1)
    want = [float(logp[i - 1, ids[i]]) for i in range(1, len(ids))]
    assert got[0] is None and len(got) == len(ids)
    assert max(abs(a - b) for a, b in zip(got[1:], want)) < 1e-4


@pytest.mark.slow
def test_live_chat_prompt_logprobs_equal_those_of_the_rendered_prompt(live_server):
    """Chat's top-level ``prompt_logprobs`` are the completions' over the same token ids."""
    url, headers = live_server.url, live_server.headers
    messages = [{"role": "user", "content": "Name a colour."}]
    ids = httpx.post(url + "/tokenize", headers=headers,
                     json={"messages": messages}).json()["tokens"]
    chat = httpx.post(url + "/v1/chat/completions", headers=headers, timeout=60, json={
        "messages": messages, "max_tokens": 1, "prompt_logprobs": 2, "temperature": 0})
    plain = httpx.post(url + "/v1/completions", headers=headers, timeout=60, json={
        "prompt": ids, "max_tokens": 1, "prompt_logprobs": 2, "temperature": 0})
    assert chat.status_code == plain.status_code == 200, chat.text
    got, want = chat.json()["prompt_logprobs"], plain.json()["choices"][0]["prompt_logprobs"]
    assert len(got) == len(ids) and got[0] is None
    for a, b in zip(got[1:], want[1:]):
        assert a.keys() == b.keys()
        assert all(abs(a[k]["logprob"] - b[k]["logprob"]) < 1e-4 for k in a)
