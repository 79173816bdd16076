"""Gated DeltaNet (kvledger.model.layers.gated_deltanet) against transformers'
``Qwen3_5GatedDeltaNet`` with the same random weights, fp32: prefills of several lengths (one
token, under, at and over the chunk), 16 decode steps carrying the state (transformers' own
cache and recurrent path), a prefill split in two equal to one, several sequences of different
lengths in one flat batch, decodes and prefills mixed; ablations (no L2 norm on q / k, the
state not carried) fail the comparison."""

from __future__ import annotations

import pytest
import torch

from kvledger.model.layers import gated_deltanet
from kvledger.model.layers.gated_deltanet import DeltaNetShape, GatedDeltaNet
from tests.model.layers.state_kit import linear_of, new_state, randomize, step

pytest.importorskip("transformers.models.qwen3_5")
TOL = 1e-4
SHAPE = DeltaNetShape(hidden_size=48, num_k_heads=2, num_v_heads=4, head_k_dim=16,
                      head_v_dim=8, conv_kernel=4)


def _pair(seed: int = 0, kernels=None):
    """(transformers' layer, ours) with the same random weights."""
    from transformers import Qwen3_5TextConfig
    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5GatedDeltaNet

    cfg = Qwen3_5TextConfig(
        hidden_size=SHAPE.hidden_size, linear_num_key_heads=SHAPE.num_k_heads,
        linear_num_value_heads=SHAPE.num_v_heads, linear_key_head_dim=SHAPE.head_k_dim,
        linear_value_head_dim=SHAPE.head_v_dim, linear_conv_kernel_dim=SHAPE.conv_kernel,
        num_hidden_layers=1, layer_types=["linear_attention"])
    theirs = Qwen3_5GatedDeltaNet(cfg, 0).eval()
    w = {f"model.layers.0.linear_attn.{k}": v.clone() for k, v in randomize(theirs, seed).items()}
    ours = GatedDeltaNet.from_weights(SHAPE, w, "model.layers.0.", linear_of(w), kernels)
    assert not w
    return cfg, theirs, ours


def _theirs(cfg, theirs, chunks: list[torch.Tensor]) -> torch.Tensor:
    """transformers' outputs over successive inputs [L_i, hidden] with its cache."""
    from transformers import DynamicCache

    cache = DynamicCache(config=cfg)
    with torch.no_grad():
        return torch.cat([theirs(x[None], cache=cache)[0] for x in chunks])


def _close(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and bool((a - b).abs().max() <= TOL)


@pytest.mark.parametrize("length", [1, 5, 64, 100, 130])
def test_prefill_then_decode(length):
    cfg, theirs, ours = _pair()
    x = torch.randn(length + 16, SHAPE.hidden_size)
    want = _theirs(cfg, theirs, [x[:length], *x[length:].split(1)])
    state = new_state(SHAPE.state_shapes(), 1)
    got = step(ours, [x[:length]], state, [True])
    for t in range(16):
        got += step(ours, [x[length + t:length + t + 1]], state, [False])
    assert _close(torch.cat(got), want)


@pytest.mark.parametrize("first", [2, 64, 70])
def test_split_prefill_equals_one(first):
    cfg, theirs, ours = _pair(1)
    x = torch.randn(150, SHAPE.hidden_size)
    whole, parts = new_state(SHAPE.state_shapes(), 1), new_state(SHAPE.state_shapes(), 1)
    one = step(ours, [x], whole, [True])[0]
    two = torch.cat(step(ours, [x[:first]], parts, [True])
                    + step(ours, [x[first:]], parts, [False]))
    assert _close(two, one) and _close(one, _theirs(cfg, theirs, [x]))
    assert _close(parts.recurrent, whole.recurrent) and _close(parts.conv, whole.conv)


def test_flat_batch_of_sequences():
    """Three sequences prefill together (lengths 3, 1 and 97), then decode together, then one
    prefills more while the others decode: each equals transformers alone."""
    cfg, theirs, ours = _pair(2)
    xs = [torch.randn(n, SHAPE.hidden_size) for n in (3 + 1 + 40, 1 + 1 + 1, 97 + 1 + 1)]
    state = new_state(SHAPE.state_shapes(), 3)
    out = [[o] for o in step(ours, [xs[0][:3], xs[1][:1], xs[2][:97]], state, [True] * 3)]
    for o, got in zip(out, step(ours, [xs[0][3:4], xs[1][1:2], xs[2][97:98]], state, [False] * 3)):
        o.append(got)
    for o, got in zip(out, step(ours, [xs[0][4:], xs[1][2:], xs[2][98:]], state, [False] * 3)):
        o.append(got)
    for x, o, cut in zip(xs, out, (3, 1, 97)):
        want = _theirs(cfg, theirs, [x[:cut], x[cut:cut + 1], x[cut + 1:]])
        assert _close(torch.cat(o), want)


def test_ablations_fail(monkeypatch):
    cfg, theirs, ours = _pair(3)
    x = torch.randn(80, SHAPE.hidden_size)
    want = _theirs(cfg, theirs, [x[:50], x[50:]])
    state = new_state(SHAPE.state_shapes(), 1)
    forgetful = torch.cat(step(ours, [x[:50]], state, [True]) + step(ours, [x[50:]], state, [True]))
    assert not _close(forgetful, want)
    monkeypatch.setattr(gated_deltanet, "l2_normed", lambda t, eps=1e-6: t)
    state = new_state(SHAPE.state_shapes(), 1)
    unnormed = torch.cat(step(ours, [x[:50]], state, [True]) + step(ours, [x[50:]], state, [False]))
    assert not _close(unnormed, want)
