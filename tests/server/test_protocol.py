"""Request models: OpenAI defaults, vLLM extensions, and what is refused."""

import json

import pytest
from pydantic import ValidationError

from kvledger.server.openai.errors import error_body
from kvledger.server.openai.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    TokenizeRequest,
)

MSG = [{"role": "user", "content": "hi"}]


def test_completion_defaults():
    params = CompletionRequest(prompt="x").sampling_params()
    # OpenAI's legacy completions and vLLM: max_tokens 16; temperature, top_p 1
    assert (params.max_tokens, params.temperature, params.top_p) == (16, 1.0, 1.0)
    assert params.logprobs is None and not params.ignore_eos


def test_chat_max_tokens_omitted_means_up_to_the_limit():
    assert ChatCompletionRequest(messages=MSG).sampling_params().max_tokens is None


def test_max_completion_tokens_wins_over_max_tokens():
    req = ChatCompletionRequest(messages=MSG, max_tokens=50, max_completion_tokens=7)
    assert req.sampling_params().max_tokens == 7


def test_vllm_extensions_and_stop_string():
    req = ChatCompletionRequest(messages=MSG, top_k=5, ignore_eos=True, stop="END", seed=3)
    params = req.sampling_params()
    assert (params.top_k, params.ignore_eos, params.stop, params.seed) == (5, True, ["END"], 3)


def test_chat_logprobs_map_to_top_alternatives():
    assert ChatCompletionRequest(messages=MSG, logprobs=True).sampling_params().logprobs == 0
    req = ChatCompletionRequest(messages=MSG, logprobs=True, top_logprobs=3)
    assert req.sampling_params().logprobs == 3


def test_text_parts_are_joined():
    req = ChatCompletionRequest(messages=[{"role": "user", "content": [
        {"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}])
    assert req.template_messages() == [{"role": "user", "content": "ab"}]


@pytest.mark.parametrize("bad", [
    {"messages": []},
    {"messages": MSG, "max_tokens": -1},
    {"messages": MSG, "max_tokens": 0},
    {"messages": MSG, "n": 2},
    {"messages": MSG, "temperature": -0.5},
    {"messages": MSG, "top_p": 0},
    {"messages": MSG, "top_logprobs": 2},
    {"messages": [{"role": "wizard", "content": "x"}]},
])
def test_invalid_chat_bodies_are_refused(bad):
    with pytest.raises(ValidationError):
        ChatCompletionRequest.model_validate(bad)


@pytest.mark.parametrize("bad", [{"prompt": ""}, {"prompt": []}, {"prompt": [-1]},
                                 {"prompt": "x", "logprobs": 21},
                                 {"prompt": "x", "prompt_logprobs": 21},
                                 {"prompt": "x", "max_tokens": 0},
                                 {"prompt": "x", "echo": True, "stream": True},
                                 {"prompt": "x", "prompt_logprobs": 1, "stream": True}])
def test_invalid_completion_bodies_are_refused(bad):
    with pytest.raises(ValidationError):
        CompletionRequest.model_validate(bad)


def test_tokenize_needs_exactly_one_input():
    assert TokenizeRequest(prompt="x").engine_input() == "x"
    assert TokenizeRequest(messages=MSG).engine_input() == MSG
    for bad in ({}, {"prompt": "x", "messages": MSG}):
        with pytest.raises(ValidationError):
            TokenizeRequest.model_validate(bad)


def test_error_body_has_the_openai_shape():
    assert error_body("m", "t", "p", "c") == {
        "error": {"message": "m", "type": "t", "param": "p", "code": "c"}}


def test_tiny_temperature_decodes_greedily_as_in_vllm():
    # logits / 1e-300 overflow to inf; vLLM treats temperatures below 1e-5 as greedy
    assert ChatCompletionRequest(messages=MSG, temperature=1e-300).sampling_params().greedy
    assert ChatCompletionRequest(messages=MSG, temperature=1e-3).sampling_params().temperature \
        == 1e-3


def test_seed_is_an_int64():
    assert ChatCompletionRequest(messages=MSG, seed=-(2**63)).sampling_params().seed == -(2**63)
    with pytest.raises(ValidationError):
        ChatCompletionRequest(messages=MSG, seed=2**63)


def test_a_tiny_nucleus_decodes_greedily():
    # top_p = 1e-300 keeps only the most likely token (and is 0.0 in fp32)
    params = CompletionRequest(prompt="x", top_p=1e-300).sampling_params()
    assert params.greedy and params.top_p == 1.0


@pytest.mark.parametrize("bad", [
    '{"messages": [{"role": "user", "content": "\\udfff"}]}',
    '{"messages": [{"role": "user", "content": [{"type": "text", "text": "\\ud800"}]}]}',
    '{"messages": [{"role": "user", "content": "x"}], "model": "\\ud800"}',
    '{"messages": [{"role": "user", "content": "x"}], "stop": ["\\ud800"]}',
])
def test_lone_surrogates_are_refused(bad):
    with pytest.raises(ValidationError, match="lone surrogates"):
        ChatCompletionRequest.model_validate(json.loads(bad))  # FastAPI parses with json.loads


@pytest.mark.parametrize("field", [{"stream": "yes"}, {"max_tokens": True},
                                   {"temperature": "0.5"}, {"top_k": 2.5}])
def test_json_types_are_strict(field):
    with pytest.raises(ValidationError):
        CompletionRequest(prompt="hi", **field)
