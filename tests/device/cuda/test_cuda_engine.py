"""The engine end to end on the CUDA device: a tiny random Llama (transformers) generates, with
a prefix-cache hit, transformers' greedy tokens in fp32 over a full-precision pool and in bf16
with int8 weights (the Triton product) over an int8 pool (the Triton encoder and quantized
attention kernel), each quantized run also the CPU engine's tokens in the same formats; over
an int4 pool in fp32, the CPU engine's (int4 moves this random model off transformers' fp32
tokens on both devices). On a GPU these run on it (``gpu``
marker); here on CPU tensors under Triton's interpreter, the device's test mode
(``KVLEDGER_CUDA_ON_CPU=1``). Also: a model placed on a device keeps no tensor behind
(checked on the ``meta`` device by a traversal of everything the model references), what the
device does not run is refused by name, and the test mode needs both variables."""

from __future__ import annotations

import gc
import types

import pytest
import torch

from kvledger.device import resolve
from kvledger.device.placement import place
from kvledger.engine.config import EngineConfig
from kvledger.engine.engine import LLMEngine
from kvledger.engine.sample.sampling_params import SamplingParams
from kvledger.errors import InvalidParameterError
from kvledger.model.weights.loader import load_weights

pytest.importorskip("triton", reason="triton is not installed (pip install -e '.[cuda]')")
pytestmark = pytest.mark.triton

PROMPT = list(range(3, 24))  # 21 tokens: 5 full blocks of 4, the hit's prefix
FOLLOW_UP = [*PROMPT, 50, 51, 52]
STEPS = 3


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """(folder, transformers' greedy tokens after PROMPT and after FOLLOW_UP) of a random
    2-layer Llama (GQA 4/2, head 16, untied head)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=320, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                      bos_token_id=1, eos_token_id=2, pad_token_id=0, tie_word_embeddings=False)
    hf = LlamaForCausalLM(cfg).eval()
    folder = tmp_path_factory.mktemp("tiny-llama")
    hf.save_pretrained(folder)
    greedy = []
    with torch.no_grad():
        for p in (PROMPT, FOLLOW_UP):
            out = hf.generate(torch.tensor([p]), max_new_tokens=STEPS, do_sample=False,
                              min_new_tokens=STEPS)
            greedy.append(out[0, len(p):].tolist())
    return folder, greedy


@pytest.fixture
def cuda_path(dev, monkeypatch):
    """The CUDA device: the GPU where there is one, else its test mode on CPU tensors."""
    if dev == "cpu":
        monkeypatch.setenv("KVLEDGER_CUDA_ON_CPU", "1")
    return resolve("cuda")



def _generate(folder, device: str, dtype: str, kv: str) -> tuple[list, list, int, object]:
    """(greedy tokens after PROMPT, after FOLLOW_UP, its cached tokens, the engine); a lossy
    pool seals each block when full (the residual window one block, no intact prefix), so
    the follow-up's hit reads sealed blocks."""
    spec, weights = load_weights(folder, torch.float32 if dtype == "fp32" else torch.bfloat16)
    lossy = {} if kv == "auto" else {"kv_residual_tokens": 4, "kv_intact_tokens": 0}
    engine = LLMEngine(EngineConfig(model=str(folder), dtype=dtype, device=device,
                                    kv_cache_dtype=kv, block_size=4, max_num_seqs=2, **lossy),
                       spec=spec, weights=weights)
    got = []
    for rid, prompt in (("a", PROMPT), ("b", FOLLOW_UP)):
        engine.add_request(rid, prompt, SamplingParams(max_tokens=STEPS, temperature=0.0,
                                                       ignore_eos=True))
        while engine.has_unfinished_requests():
            got += [o for o in engine.step() if o.finished]
    return got[0].token_ids, got[1].token_ids, got[1].metrics.num_cached_tokens, engine


@pytest.mark.parametrize("dtype,kv,weights", [("fp32", "auto", "dense"),
                                              ("fp32", "int4", "dense"),
                                              ("bf16", "int8", "int8")])
def test_the_engine_on_the_cuda_device_generates_the_greedy_tokens_of_the_oracles(
        tiny, cuda_path, dtype, kv, weights, monkeypatch, count_calls):
    folder, want = tiny
    monkeypatch.setenv("KVLEDGER_WEIGHT_FORMAT", weights)
    attend = count_calls("paged_attention",
                      "paged_attention" if kv == "auto" else "paged_attention_quantized")
    encode = count_calls("kv_int", "encode_into")
    product = count_calls("linear_int8", "int8_matmul")
    first, second, cached, engine = _generate(folder, "cuda", dtype, kv)
    assert cached == 20, "the follow-up did not hit the first prompt's 5 full blocks"
    on, head = cuda_path.torch_device.type, engine.model.lm_head
    pool = engine.store.key_blocks[0] if kv == "auto" else engine.store.key_parts[0]["codes"]
    held = head.weight if head.weight is not None else head.packed
    assert pool.device.type == on and held.device.type == on
    assert attend, "the Triton paged-attention kernel did not attend"
    assert bool(encode) == (kv != "auto") and bool(product) == (weights == "int8")
    if kv != "int4":
        assert (first, second) == (want[0], want[1])
    if kv != "auto":  # the CPU engine in the same formats picks the same tokens
        monkeypatch.delenv("KVLEDGER_CUDA_ON_CPU", raising=False)
        assert _generate(folder, "cpu", dtype, kv)[:3] == (first, second, cached)


def _tensors(root) -> list[torch.Tensor]:
    """Every tensor reachable from ``root`` through the garbage collector's references
    (closures and bound methods included; modules, classes and module globals skipped)."""
    seen, stack, found = set(), [root], []
    while stack:
        x = stack.pop()
        if id(x) in seen or isinstance(x, (types.ModuleType, type, str, bytes, int, float)):
            continue
        seen.add(id(x))
        if isinstance(x, torch.Tensor):
            found.append(x)
        elif isinstance(x, types.FunctionType):
            stack += [c.cell_contents for c in x.__closure__ or ()] + list(x.__defaults__ or ())
        elif not (isinstance(x, dict) and "__builtins__" in x):
            stack += gc.get_referents(x)
    return found


@pytest.mark.parametrize("weights", ["dense", "int8"])
def test_a_model_placed_on_a_device_keeps_no_tensor_behind(tiny, cuda_path, weights,
                                                           monkeypatch):
    monkeypatch.setenv("KVLEDGER_WEIGHT_FORMAT", weights)
    spec, w = load_weights(tiny[0], torch.bfloat16)
    engine = LLMEngine(EngineConfig(model=str(tiny[0]), dtype="bf16", device="cuda",
                                    block_size=4), spec=spec, weights=w)
    lm_head = engine.model.lm_head
    place(engine.model, torch.device("meta"))
    found = _tensors(engine.model)
    assert len(found) > 10 and {t.device.type for t in found} == {"meta"}
    assert engine.model.lm_head is lm_head and engine.model.layers[0]["attn"] is not None


def test_what_the_cuda_device_does_not_run_is_refused_by_name(tiny, cuda_path):
    spec, w = load_weights(tiny[0], torch.float32)
    for option, named in (({"kv_policy": "window", "kv_window": 16}, "window retention"),
                          ({"speculative_config": {"method": "ngram",
                                                   "num_speculative_tokens": 2}},
                           "speculative decoding")):
        with pytest.raises(InvalidParameterError, match=f"--device cuda does not run .*{named}"):
            LLMEngine(EngineConfig(model=str(tiny[0]), dtype="fp32", device="cuda", **option),
                      spec=spec, weights=w)


def test_a_request_asking_for_a_retention_policy_is_refused_and_the_engine_serves_on(
        tiny, cuda_path):
    spec, w = load_weights(tiny[0], torch.float32)
    engine = LLMEngine(EngineConfig(model=str(tiny[0]), dtype="fp32", device="cuda",
                                    block_size=4), spec=spec, weights=w)
    with pytest.raises(InvalidParameterError, match="--device cuda does not run the window "
                                                    "retention policy"):
        engine.add_request("w", PROMPT, SamplingParams(max_tokens=2, kv_policy={
            "policy": "window", "window": 8}))
    engine.add_request("ok", PROMPT[:5], SamplingParams(max_tokens=1, temperature=0.0))
    while engine.has_unfinished_requests():
        engine.step()
    assert "w" not in engine.scheduler.requests


def test_the_probe_refuses_the_cuda_device_whose_choices_are_fixed(cuda_path, tmp_path,
                                                                   monkeypatch):
    from typer.testing import CliRunner

    from kvledger.cli import app

    monkeypatch.setenv("KVLEDGER_CONFIG_DIR", str(tmp_path))
    r = CliRunner().invoke(app, ["probe", "--device", "cuda"])
    assert r.exit_code == 2 and "is not probed: its choices are fixed" in r.output, r.output
    assert list(tmp_path.iterdir()) == []


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a CUDA GPU")
def test_the_test_mode_needs_both_the_interpreter_and_the_opt_in(monkeypatch):
    monkeypatch.setenv("KVLEDGER_CUDA_ON_CPU", "1")
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(InvalidParameterError, match="sees no CUDA GPU"):
        resolve("cuda")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert resolve("cuda").torch_device == torch.device("cpu")
    monkeypatch.delenv("KVLEDGER_CUDA_ON_CPU")
    with pytest.raises(InvalidParameterError, match="sees no CUDA GPU"):
        resolve("cuda")
