"""State layers in the ledger: state bytes per sequence by hand for the catalogue's hybrids,
plan's concurrency from KV and state together, GGUF headers as llama.cpp's converter writes
them, and bad configs refused naming the field."""

from __future__ import annotations

import json

import numpy as np
import pytest
from typer.testing import CliRunner

from kvledger.cli import app
from kvledger.ledger import costs
from kvledger.ledger.hardware import get_device
from kvledger.ledger.kv import fixed_state_bytes, kv_bytes_per_sequence
from kvledger.ledger.kv_format import KVFormatSpec
from kvledger.ledger.kv_groups import state_group
from kvledger.ledger.params import count_params
from kvledger.ledger.planner import PlanOptions, plan
from kvledger.model.families import load_spec, spec_from_gguf
from kvledger.spec import CONV, FULL, LINEAR, MAMBA

BF16 = KVFormatSpec("bf16")


def test_qwen3_5_0_8b_state_by_hand(real_spec):
    """18 gated DeltaNet layers: 16 value heads x 128 x 128 recurrent, a 3-step conv tail over
    2 x 16 x 128 (q, k) + 16 x 128 (v) channels, in bf16; 6 full layers of 2 KV heads x 256."""
    spec = real_spec("Qwen__Qwen3.5-0.8B")
    assert spec.layers.types.count(LINEAR) == 18
    per_layer = 16 * 128 * 128 + 3 * (2 * 16 * 128 + 16 * 128)
    assert fixed_state_bytes(spec) == 18 * per_layer * 2 == 10_100_736
    assert kv_bytes_per_sequence(spec, BF16, 1, 16, 1000) == 1000 * 6 * 2 * 2 * 256 * 2


def test_qwen3_5_35b_a3b_state_by_hand(real_spec):
    spec = real_spec("Qwen__Qwen3.5-35B-A3B")
    assert spec.experts.count == 256 and spec.experts.shared_gate
    assert fixed_state_bytes(spec) == 30 * (32 * 128 * 128 + 3 * (2 * 16 * 128 + 32 * 128)) * 2


@pytest.mark.parametrize("name, linear, full, kv_heads, value_heads", [
    ("Qwen__Qwen3.5-2B", 18, 6, 2, 16),
    ("Qwen__Qwen3.5-4B", 24, 8, 4, 32),
    ("Qwen__Qwen3.5-9B", 24, 8, 4, 32),
])
def test_qwen3_5_dense_sizes_state_by_hand(real_spec, name, linear, full, kv_heads, value_heads):
    """Each DeltaNet layer: value heads x 128 x 128 recurrent and a 3-step conv tail over
    2 x 16 x 128 (q, k) + value heads x 128 (v) channels; full layers hold KV heads x 256."""
    spec = real_spec(name)
    assert spec.layers.types.count(LINEAR) == linear and spec.layers.types.count(FULL) == full
    per_layer = value_heads * 128 * 128 + 3 * (2 * 16 * 128 + value_heads * 128)
    assert fixed_state_bytes(spec) == linear * per_layer * 2
    assert kv_bytes_per_sequence(spec, BF16, 1, 16, 1000) == 1000 * full * 2 * kv_heads * 256 * 2


@pytest.mark.parametrize("name, conv, full, hidden, mlp", [
    ("LiquidAI__LFM2-350M", 10, 6, 1024, 4608),
    ("LiquidAI__LFM2-2.6B", 22, 8, 2048, 10752),
])
def test_lfm2_sizes_state_by_hand(real_spec, name, conv, full, hidden, mlp):
    """Short-conv layers keep the last 2 of B * x over ``hidden`` channels; the 350M's MLP is
    6656 brought to 4608 (2/3, rounded up to 256), the 2.6B's 10752 as is (no auto-adjust)."""
    spec = real_spec(name)
    assert spec.layers.types.count(CONV) == conv and spec.layers.types.count(FULL) == full
    assert spec.intermediate_size == mlp
    assert fixed_state_bytes(spec) == conv * hidden * 2 * 2
    assert kv_bytes_per_sequence(spec, BF16, 1, 16, 1000) == 1000 * full * 2 * 8 * 64 * 2


def test_lfm2_1_2b_state_by_hand(real_spec):
    """10 short-conv layers keep the last 2 of B * x over 2048 channels; the MLP is
    ``block_ff_dim`` 12288 brought to 8192 (2/3, rounded up to 256)."""
    spec = real_spec("LiquidAI__LFM2-1.2B")
    assert spec.layers.types.count(CONV) == 10 and spec.intermediate_size == 8192
    assert fixed_state_bytes(spec) == 10 * 2048 * 2 * 2 == 81_920
    group = state_group(spec)
    assert group.conv_shape == (2048, 2) and group.recurrent_shape == ()
    assert group.slot_elements() * 2 == fixed_state_bytes(spec)


def test_granite_4_h_micro_state_by_hand(real_spec):
    """36 Mamba-2 layers: 64 heads x 64 x 128 SSM state and 3 steps of the conv over
    64 x 64 + 2 x 128 channels, in bf16."""
    spec = real_spec("ibm-granite__granite-4.0-h-micro")
    assert spec.layers.types.count(MAMBA) == 36 and not spec.is_moe
    assert spec.intermediate_size == 8192
    assert fixed_state_bytes(spec) == 36 * (64 * 64 * 128 + 3 * (4096 + 2 * 128)) * 2


def test_granite_4_h_tiny_by_hand(real_spec):
    """The catalogue's Granite-4.0-H-Tiny: 36 Mamba-2 layers of 48 heads x 64 x 128 SSM state
    and 3 conv steps over 48 x 64 + 2 x 128 channels, in bf16; 64 experts, 6 per token, beside
    the shared MLP of 1024; about 7B parameters, its model card's figure (one digit)."""
    spec = real_spec("ibm-granite__granite-4.0-h-tiny")
    assert spec.layers.types.count(MAMBA) == 36 and spec.rope.position_embedding_type == "nope"
    assert fixed_state_bytes(spec) == 36 * (48 * 64 * 128 + 3 * (3072 + 2 * 128)) * 2
    assert (spec.experts.count, spec.experts.per_token, spec.experts.intermediate_size) == (
        64, 6, 512)
    assert (spec.experts.shared_count, spec.experts.shared_intermediate_size) == (1, 1024)
    assert round(count_params(spec).total / 1e9) == 7


def test_granite_hybrid_state_by_hand(tmp_path):
    """Granite-4.0-H-Tiny's Mamba-2 shape (hidden 1536, 48 heads of 64, d_state 128, one
    group, 4 taps): per Mamba layer 48 x 64 x 128 SSM + 3 x (3072 + 2 x 128) conv values."""
    from transformers import GraniteMoeHybridConfig

    kinds = ["mamba"] * 5 + ["attention"] + ["mamba"] * 4
    GraniteMoeHybridConfig(
        hidden_size=1536, num_hidden_layers=10, num_attention_heads=12, num_key_value_heads=4,
        mamba_n_heads=48, mamba_d_head=64, mamba_d_state=128, mamba_n_groups=1,
        mamba_d_conv=4, mamba_expand=2, num_local_experts=4, num_experts_per_tok=2,
        intermediate_size=512, shared_intermediate_size=1024,
        layer_types=["linear_attention" if k == "mamba" else "attention" for k in kinds],
    ).save_pretrained(tmp_path)
    spec = load_spec(tmp_path)
    assert spec.layers.types == tuple(MAMBA if k == "mamba" else FULL for k in kinds)
    assert fixed_state_bytes(spec) == 9 * (48 * 64 * 128 + 3 * (3072 + 2 * 128)) * 2
    assert spec.experts.count == 4 and spec.experts.shared_intermediate_size == 1024


def test_plan_concurrency_counts_state_and_kv(real_spec):
    """A request of 4,096 tokens holds 256 blocks of 16 in the 6 full layers and one state
    slot; the pool holds as many requests as both fit."""
    spec = real_spec("Qwen__Qwen3.5-0.8B")
    p = plan(spec, get_device("H100-SXM"), PlanOptions(contexts=(4096,)))
    state = 10_100_736
    block = 16 * 6 * 2 * 2 * 256 * 2
    assert p.state_bytes_per_sequence == state and p.contexts[0].fixed_state_bytes == state
    assert p.contexts[0].max_concurrency == costs.max_concurrency(p.pool_bytes,
                                                                  256 * block + state)
    assert p.contexts[0].max_concurrency < p.pool_bytes // (256 * block)


def test_plan_prints_state_beside_kv(real_spec, tmp_path):
    result = CliRunner().invoke(app, ["plan", "Qwen/Qwen3.5-0.8B", "--device", "H100-SXM"])
    assert result.exit_code == 0, result.output
    assert "state per sequence 9.6 MiB" in result.output
    assert "KV per token 12.0 KiB" in result.output


def _bad(tmp_path, base: str, **changes) -> str:
    from kvledger.data import config_path

    cfg = json.loads(config_path(base).read_text())
    target = cfg.get("text_config", cfg)
    for key, value in changes.items():
        target[key] = value
    path = tmp_path / "config.json"
    path.write_text(json.dumps(cfg))
    result = CliRunner().invoke(app, ["plan", str(path)])
    assert result.exit_code == 2, result.output
    return result.output


@pytest.mark.parametrize("base, changes, field", [
    ("Qwen__Qwen3.5-0.8B", {"layer_types": ["linear_attention", "bogus"] * 12}, "layer_types"),
    ("Qwen__Qwen3.5-0.8B", {"linear_num_value_heads": 24}, "linear_num_value_heads"),
    ("Qwen__Qwen3.5-0.8B", {"linear_conv_kernel_dim": 1}, "linear_conv_kernel_dim"),
    ("LiquidAI__LFM2-1.2B", {"conv_L_cache": 1}, "conv_L_cache"),
    ("LiquidAI__LFM2-1.2B", {"full_attn_idxs": [2, 99]}, "full_attn_idxs"),
])
def test_bad_state_configs_exit_2_naming_the_field(tmp_path, base, changes, field):
    out = _bad(tmp_path, base, **changes)
    assert "error:" in out and field in out


def test_granite_inconsistent_heads_named(tmp_path):
    from transformers import GraniteMoeHybridConfig

    GraniteMoeHybridConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                           mamba_n_heads=4, mamba_d_head=32, mamba_expand=2,
                           layer_types=["linear_attention", "attention"]).save_pretrained(tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg["mamba_n_heads"] = 3  # 3 x 32 != 2 x 64
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    result = CliRunner().invoke(app, ["plan", str(tmp_path)])
    assert result.exit_code == 2 and "mamba_n_heads" in result.output, result.output


def _gguf(path, arch: str, meta: dict):
    import gguf

    w = gguf.GGUFWriter(str(path), arch)
    for key, value in meta.items():
        full = f"{arch}.{key}"
        if isinstance(value, list):
            w.add_array(full, value)
        elif isinstance(value, float):
            w.add_float32(full, value)
        else:
            w.add_uint32(full, value)
    w.add_tokenizer_model("gpt2")
    w.add_token_list([f"t{i}" for i in range(32)])
    w.add_tensor("token_embd.weight", np.zeros((32, 16), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


_COMMON = {"block_count": 4, "context_length": 64, "embedding_length": 16,
           "feed_forward_length": 32, "attention.head_count": 4,
           "attention.layer_norm_rms_epsilon": 1e-5, "vocab_size": 32}


def test_gguf_lfm2_header(tmp_path):
    """llama.cpp's converter: KV heads per layer, 0 on a conv layer; ``shortconv.l_cache``."""
    spec = spec_from_gguf(_gguf(tmp_path / "l.gguf", "lfm2", _COMMON | {
        "attention.head_count_kv": [0, 2, 0, 2], "shortconv.l_cache": 3}))
    assert spec.model_type == "lfm2" and spec.num_kv_heads == 2
    assert spec.layers.types == (CONV, FULL, CONV, FULL)
    assert fixed_state_bytes(spec, 4) == 2 * 16 * 2 * 4


def test_gguf_qwen35_header(tmp_path):
    spec = spec_from_gguf(_gguf(tmp_path / "q.gguf", "qwen35", _COMMON | {
        "attention.head_count_kv": 2, "attention.key_length": 8, "ssm.conv_kernel": 4,
        "ssm.state_size": 4, "ssm.group_count": 2, "ssm.time_step_rank": 4,
        "ssm.inner_size": 16, "full_attention_interval": 2}))
    assert spec.model_type == "qwen3_5_text"
    assert spec.layers.types == (LINEAR, FULL, LINEAR, FULL)
    assert spec.state.recurrent_shape == (4, 4, 4) and spec.state.conv_dim == 2 * 2 * 4 + 16


def test_gguf_granitehybrid_header_and_a_missing_key(tmp_path):
    meta = _COMMON | {"attention.head_count_kv": [0, 0, 0, 2], "ssm.conv_kernel": 4,
                      "ssm.state_size": 8, "ssm.group_count": 1, "ssm.time_step_rank": 4,
                      "ssm.inner_size": 32}
    spec = spec_from_gguf(_gguf(tmp_path / "g.gguf", "granitehybrid", meta))
    assert spec.layers.types == (MAMBA, MAMBA, MAMBA, FULL)
    assert spec.state.recurrent_shape == (4, 8, 8) and spec.state.conv_dim == 32 + 2 * 8
    from kvledger.errors import ConfigError

    with pytest.raises(ConfigError, match="ssm.state_size"):
        spec_from_gguf(_gguf(tmp_path / "h.gguf", "granitehybrid",
                             {k: v for k, v in meta.items() if k != "ssm.state_size"}))


def test_lfm2_params_match_transformers(tmp_path):
    """The ledger's parameter count of a small LFM2 against transformers' own model."""
    import torch
    from transformers import Lfm2Config, Lfm2ForCausalLM

    cfg = Lfm2Config(vocab_size=96, hidden_size=64, intermediate_size=192, num_hidden_layers=4,
                     num_attention_heads=4, num_key_value_heads=2, full_attn_idxs=[1, 3],
                     block_multiple_of=16, conv_bias=True, tie_word_embeddings=False)
    cfg.save_pretrained(tmp_path)
    torch.manual_seed(0)
    model = Lfm2ForCausalLM(cfg)
    from kvledger.ledger.params import count_params

    assert count_params(load_spec(tmp_path)).total == sum(p.numel() for p in model.parameters())
