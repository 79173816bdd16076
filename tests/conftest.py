"""Shared test fixtures.

``gguf_kit`` builds tiny llama-family GGUF files with the ``gguf`` package's own writer, so
GGUF reading and loading are tested against files produced by an independent implementation.
``tiny_llama`` / ``tiny_llama_folder`` save tiny random Llamas with transformers (HF format);
``bundled_path`` and ``hf_oracle`` are the bundled GGUF and transformers' own load of it.
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

TINY = {"layers": 1, "hidden": 32, "heads": 2, "kv_heads": 1, "ffn": 64, "vocab": 10, "ctx": 64}


def llamacpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp convert_hf_to_gguf ``LlamaModel.permute`` (HF rotate-half rows -> pairs)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(
        w.shape
    )


def tiny_hf_weights(seed: int = 0, tied: bool = True) -> dict[str, np.ndarray]:
    """Random fp32 weights of a TINY Llama with Hugging Face names and [out, in] shapes."""
    rng = np.random.default_rng(seed)
    h, f, v = TINY["hidden"], TINY["ffn"], TINY["vocab"]
    d = h // TINY["heads"]
    shapes = {
        "model.embed_tokens.weight": (v, h),
        "model.norm.weight": (h,),
        "model.layers.0.input_layernorm.weight": (h,),
        "model.layers.0.post_attention_layernorm.weight": (h,),
        "model.layers.0.self_attn.q_proj.weight": (TINY["heads"] * d, h),
        "model.layers.0.self_attn.k_proj.weight": (TINY["kv_heads"] * d, h),
        "model.layers.0.self_attn.v_proj.weight": (TINY["kv_heads"] * d, h),
        "model.layers.0.self_attn.o_proj.weight": (h, TINY["heads"] * d),
        "model.layers.0.mlp.gate_proj.weight": (f, h),
        "model.layers.0.mlp.up_proj.weight": (f, h),
        "model.layers.0.mlp.down_proj.weight": (h, f),
    }
    if not tied:
        shapes["lm_head.weight"] = (v, h)
    return {k: rng.standard_normal(s).astype(np.float32) for k, s in shapes.items()}


# HF name -> GGUF name, written out by hand from llama.cpp's tensor naming (gguf/constants.py).
HF_TO_GGUF = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
    "model.layers.0.input_layernorm.weight": "blk.0.attn_norm.weight",
    "model.layers.0.post_attention_layernorm.weight": "blk.0.ffn_norm.weight",
    "model.layers.0.self_attn.q_proj.weight": "blk.0.attn_q.weight",
    "model.layers.0.self_attn.k_proj.weight": "blk.0.attn_k.weight",
    "model.layers.0.self_attn.v_proj.weight": "blk.0.attn_v.weight",
    "model.layers.0.self_attn.o_proj.weight": "blk.0.attn_output.weight",
    "model.layers.0.mlp.gate_proj.weight": "blk.0.ffn_gate.weight",
    "model.layers.0.mlp.up_proj.weight": "blk.0.ffn_up.weight",
    "model.layers.0.mlp.down_proj.weight": "blk.0.ffn_down.weight",
}


def gguf_tensors_from_hf(hf: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """What llama.cpp's converter writes for ``hf``: GGUF names, Q/K rows permuted."""
    out = {}
    for name, w in hf.items():
        if name.endswith("q_proj.weight"):
            w = llamacpp_permute(w, TINY["heads"])
        elif name.endswith("k_proj.weight"):
            w = llamacpp_permute(w, TINY["kv_heads"])
        out[HF_TO_GGUF[name]] = w
    return out


def _write_gguf(
    path: Path,
    tensors: dict,
    *,
    arch: str = "llama",
    omit: tuple[str, ...] = (),
    tokens: list[str] | None = None,
    extra: dict | None = None,
) -> Path:
    """Write a GGUF with TINY's metadata and ``tensors`` (name -> float array, or
    name -> (uint8 block bytes [rows, row_bytes], GGMLQuantizationType)); ``omit`` drops
    metadata keys (without the ``{arch}.`` prefix), ``extra`` adds ``key -> value``."""
    import gguf

    w = gguf.GGUFWriter(str(path), arch)
    meta = {
        "block_count": TINY["layers"], "context_length": TINY["ctx"],
        "embedding_length": TINY["hidden"], "feed_forward_length": TINY["ffn"],
        "attention.head_count": TINY["heads"], "attention.head_count_kv": TINY["kv_heads"],
        "attention.layer_norm_rms_epsilon": 1e-5, "rope.freq_base": 10000.0,
        "vocab_size": TINY["vocab"],
    }
    for key, value in {**meta, **(extra or {})}.items():
        if key in omit:
            continue
        full = key if key.startswith(("general.", "tokenizer.")) else f"{arch}.{key}"
        if isinstance(value, str):
            w.add_string(full, value)
        elif isinstance(value, float):
            w.add_float32(full, value)
        else:
            w.add_uint32(full, value)
    w.add_tokenizer_model("gpt2")
    w.add_token_list(tokens or [f"t{i}" for i in range(TINY["vocab"])])
    w.add_bos_token_id(0)
    w.add_eos_token_id(1)
    for name, value in tensors.items():
        if isinstance(value, tuple):
            w.add_tensor(name, value[0], raw_dtype=value[1])
        else:
            w.add_tensor(name, value)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.fixture
def gguf_kit():
    """Tiny-GGUF helpers: ``write``, ``hf_weights``, ``to_gguf``, ``permute``, ``TINY``."""
    return SimpleNamespace(
        write=_write_gguf, hf_weights=tiny_hf_weights, to_gguf=gguf_tensors_from_hf,
        permute=llamacpp_permute, TINY=TINY,
    )


@pytest.fixture
def app_client():
    """``make(engine, **create_app kwargs) -> TestClient`` over the server app (lifespan entered);
    every client made is closed at teardown."""
    from fastapi.testclient import TestClient

    from kvledger.server.app import create_app

    clients = []

    def make(engine, **kwargs) -> TestClient:
        client = TestClient(create_app(engine, **kwargs))
        client.__enter__()
        clients.append(client)
        return client

    yield make
    for client in clients:
        client.__exit__(None, None, None)


@pytest.fixture(scope="session")
def bundled_tokenizer():
    """The bundled SmolLM2 tokenizer, 49,152 ids (no weights loaded)."""
    from kvledger.model.weights.loader import load_tokenizer

    return load_tokenizer("default")


@pytest.fixture(scope="session")
def grammars(bundled_tokenizer):
    """One GrammarCompiler on the bundled tokenizer (its llguidance tokenizer takes ~2 s)."""
    from kvledger.engine.sample.structured.compiler import GrammarCompiler

    return GrammarCompiler(bundled_tokenizer, len(bundled_tokenizer),
                           [bundled_tokenizer.eos_token_id])


def make_tiny_llama(folder, *, tie: bool = False, rope_scaling: dict | None = None, seed: int = 0,
                    heads: int = 4, kv_heads: int = 2, vocab: int = 320):
    """Save a small random LlamaForCausalLM (safetensors) and return the HF model (fp32, eval)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(
        vocab_size=vocab, hidden_size=64, intermediate_size=160, num_hidden_layers=3,
        num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=16,
        max_position_embeddings=512,
        rope_theta=10000.0, tie_word_embeddings=tie, rms_norm_eps=1e-5,
        rope_scaling=rope_scaling, bos_token_id=1, eos_token_id=2)
    model = LlamaForCausalLM(cfg).eval()
    model.save_pretrained(folder, safe_serialization=True)
    return model


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory):
    """(folder, hf_model): untied head, GQA 4:2, Llama-3 RoPE scaling."""
    folder = tmp_path_factory.mktemp("tiny-llama")
    scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 64}
    return folder, make_tiny_llama(folder, rope_scaling=scaling)


@pytest.fixture(scope="session")
def bundled_path():
    from kvledger.paths import bundled_model_path

    return bundled_model_path()


@pytest.fixture(scope="session")
def hf_oracle(bundled_path):
    """transformers' own load of the bundled GGUF, fp32 (~20 s): the logits oracle."""
    import torch
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(
        str(bundled_path.parent), gguf_file=bundled_path.name, dtype=torch.float32).eval()


@pytest.fixture(scope="session")
def tiny_llama_folder(tmp_path_factory):
    """``make(**make_tiny_llama options)`` -> the folder of that tiny model, saved once."""
    made: dict = {}

    def make(**options):
        key = tuple(sorted(options.items()))
        if key not in made:
            made[key] = tmp_path_factory.mktemp("tiny-llama")
            make_tiny_llama(made[key], **options)
        return made[key]

    return make


@pytest.fixture(scope="session", autouse=True)
def _private_data_dir(tmp_path_factory):
    """No test writes the user's data folder: ``kvledger serve``'s default state DB lives there
    (a test server of a newer schema would migrate the user's file). Subprocesses inherit it."""
    patch = pytest.MonkeyPatch()
    patch.setenv("KVLEDGER_DATA_DIR", str(tmp_path_factory.mktemp("data")))
    yield
    patch.undo()
