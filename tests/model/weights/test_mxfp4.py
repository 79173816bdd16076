"""MXFP4 experts (``kvledger.model.weights.mxfp4``): the decoder against transformers'
``convert_moe_packed_tensors`` and hand values, and a gpt-oss folder whose experts are stored
as ``*_blocks`` / ``*_scales`` (as the real checkpoints are) loading to transformers' logits."""

from __future__ import annotations

import json

import pytest
import torch

from kvledger.engine.kv.store import KVStore
from kvledger.engine.model_load import build_model
from kvledger.engine.request import Request
from kvledger.engine.runner import ModelRunner
from kvledger.engine.sample.sampling_params import SamplingParams
from kvledger.model.weights.loader import load_weights
from kvledger.model.weights.mxfp4 import dequantize


def _packed(shape: tuple[int, ...], seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Random MXFP4 blocks uint8 [*shape, 16] and scales uint8 [*shape] near 2^0."""
    g = torch.Generator().manual_seed(seed)
    blocks = torch.randint(0, 256, (*shape, 16), generator=g, dtype=torch.uint8)
    scales = torch.randint(120, 131, shape, generator=g, dtype=torch.uint8)
    return blocks, scales


def test_dequantize_matches_transformers():
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    blocks, scales = _packed((3, 10, 4), seed=0)
    theirs = convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)  # [3, in, out]
    torch.testing.assert_close(dequantize(blocks, scales).transpose(1, 2), theirs, rtol=0, atol=0)


def test_dequantize_by_hand():
    """Byte 0x9A: low nibble 0xA = -1.0, high nibble 0x9 = -0.5; byte 0x71: 0.5 then 6.0;
    scale 129 = x4, 126 = x0.5."""
    blocks = torch.zeros(2, 1, 16, dtype=torch.uint8)
    blocks[0, 0, 0], blocks[1, 0, 0] = 0x9A, 0x71
    out = dequantize(blocks, torch.tensor([[129], [126]], dtype=torch.uint8))
    assert out.shape == (2, 32)
    assert out[0, :2].tolist() == [-4.0, -2.0] and out[1, :2].tolist() == [0.25, 3.0]
    assert not out[:, 2:].any()


def test_mismatched_blocks_are_refused():
    with pytest.raises(ValueError, match="MXFP4 blocks"):
        dequantize(torch.zeros(2, 3, 16, dtype=torch.uint8), torch.zeros(2, 4, dtype=torch.uint8))


def test_an_mxfp4_checkpoint_loads_to_transformers_logits(tmp_path):
    """A tiny gpt-oss whose expert matrices are MXFP4 values: transformers holds them
    dequantized by its own converter, the folder stores the blocks and scales; fp32 logits
    within 1e-4."""
    import transformers as tf
    from safetensors.torch import save_file
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    config = tf.GptOssConfig(vocab_size=128, hidden_size=64, intermediate_size=32,
                             num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                             head_dim=16, num_local_experts=4, num_experts_per_tok=2,
                             sliding_window=4, max_position_embeddings=64,
                             tie_word_embeddings=False)
    torch.manual_seed(0)
    model = tf.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    state = {}
    with torch.no_grad():
        for name, param in model.named_parameters():
            param.copy_(torch.randn(param.shape) * 0.2)
        for i, layer in enumerate(model.model.layers):
            experts = layer.mlp.experts
            for proj, (out_f, in_f) in (("gate_up_proj", (64, 64)), ("down_proj", (64, 32))):
                blocks, scales = _packed((4, out_f, in_f // 32), seed=10 * i + len(proj))
                scales -= 4  # values of a few tenths
                getattr(experts, proj).copy_(
                    convert_moe_packed_tensors(blocks, scales, dtype=torch.float32))
                stem = f"model.layers.{i}.mlp.experts.{proj}"
                state |= {stem + "_blocks": blocks, stem + "_scales": scales}
    state |= {k: v.contiguous() for k, v in model.state_dict().items()
              if not k.endswith(("experts.gate_up_proj", "experts.down_proj"))}
    save_file(state, str(tmp_path / "model.safetensors"))
    raw = config.to_dict() | {"quantization_config": {"quant_method": "mxfp4"}}
    (tmp_path / "config.json").write_text(json.dumps(raw))
    spec, weights = load_weights(tmp_path, torch.float32)
    ids = torch.randint(0, 128, (12,), generator=torch.Generator().manual_seed(1))
    ours = build_model(spec, weights, torch.float32, attention="reference")
    store = KVStore(spec.num_layers, 4, 16, spec.num_kv_heads, spec.head_dim, torch.float32)
    req = Request("r", ids.tolist(), SamplingParams())
    req.block_table = [2]
    logits = ModelRunner(ours, store, 16).execute([_Chunk(req, len(ids))])[0]
    with torch.no_grad():
        ref = model(ids[None], use_cache=False).logits[0, -1]
    assert float((logits - ref).abs().max()) <= 1e-4


class _Chunk:
    def __init__(self, req, n):
        self.request, self.num_new_tokens = req, n
