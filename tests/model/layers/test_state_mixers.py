"""The state mixers against transformers with the same random weights, fp32 (within 1e-4):
gated DeltaNet (kvledger.model.layers.gated_deltanet, transformers' ``Qwen3_5GatedDeltaNet``;
``Qwen3NextGatedDeltaNet``'s fused projections through the prefill-and-decode test)
and Mamba-2 (kvledger.model.layers.mamba2, ``GraniteMoeHybridMambaLayer``). Prefills of several
lengths (one token, under, at and over the chunk, several chunks), 16 decode steps carrying the
state (against transformers' own cache and recurrent path), a prefill split in two equal to
one, several sequences of different lengths in one flat batch with decodes and prefills mixed;
ablations (the state not carried; DeltaNet without its L2 norm, Mamba-2 without its D skip)
fail the comparison. Each runs with the device's native decode steps too (``+native``,
kvledger.device.cpu.state_steps). Checkpoints: the snapshot after o tokens of a span equals the
state of the same o tokens prefilled alone, and cutting the chunks there changes no output."""

from __future__ import annotations

from functools import partial

import pytest
import torch
from mixer_kit import deltanet_pair, mamba2_pair, qwen3_next_pair, step

from kvledger.device.cpu.kernels import KERNELS
from kvledger.model.layers import gated_deltanet, mamba2

pytest.importorskip("transformers.models.qwen3_5")
TOL = 1e-4
PAIRS = {"deltanet": deltanet_pair, "mamba2": mamba2_pair,
         "deltanet+native": partial(deltanet_pair, kernels=KERNELS),
         "mamba2+native": partial(mamba2_pair, kernels=KERNELS)}


def _close(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and bool((a - b).abs().max() <= TOL)


@pytest.mark.parametrize("mixer", [*PAIRS, "qwen3_next"])
@pytest.mark.parametrize("length", [1, 5, 16, 64, 100, 130])
def test_prefill_then_decode(mixer, length):
    pair = PAIRS[mixer]() if mixer in PAIRS else qwen3_next_pair()
    assert (pair.ours.native is not None) == mixer.endswith("+native")
    x = torch.randn(length + 16, pair.shape.hidden_size)
    want = pair.theirs_over([x[:length], *x[length:].split(1)])
    state = pair.state(1)
    got = step(pair.ours, [x[:length]], state, [True])
    for t in range(16):
        got += step(pair.ours, [x[length + t:length + t + 1]], state, [False])
    assert _close(torch.cat(got), want)


@pytest.mark.parametrize("mixer", PAIRS)
@pytest.mark.parametrize("first", [2, 16, 64, 70])
def test_split_prefill_equals_one(mixer, first):
    pair = PAIRS[mixer](1)
    x = torch.randn(150, pair.shape.hidden_size)
    whole, parts = pair.state(1), pair.state(1)
    one = step(pair.ours, [x], whole, [True])[0]
    two = torch.cat(step(pair.ours, [x[:first]], parts, [True])
                    + step(pair.ours, [x[first:]], parts, [False]))
    assert _close(two, one) and _close(one, pair.theirs_over([x]))
    assert _close(parts.recurrent, whole.recurrent) and _close(parts.conv, whole.conv)


@pytest.mark.parametrize("mixer", PAIRS)
def test_flat_batch_of_sequences(mixer):
    """Three sequences prefill together (lengths 3, 1 and 97), then decode together, then one
    prefills more while the others decode: each equals transformers alone."""
    pair = PAIRS[mixer](2)
    cuts = (3, 1, 97)
    xs = [torch.randn(n, pair.shape.hidden_size) for n in (3 + 1 + 40, 1 + 1 + 1, 97 + 1 + 1)]
    state = pair.state(3)
    out = [[o] for o in step(pair.ours, [x[:c] for x, c in zip(xs, cuts)], state, [True] * 3)]
    for o, got in zip(out, step(pair.ours, [x[c:c + 1] for x, c in zip(xs, cuts)], state,
                                [False] * 3)):
        o.append(got)
    for o, got in zip(out, step(pair.ours, [x[c + 1:] for x, c in zip(xs, cuts)], state,
                                [False] * 3)):
        o.append(got)
    for x, o, c in zip(xs, out, cuts):
        assert _close(torch.cat(o), pair.theirs_over([x[:c], x[c:c + 1], x[c + 1:]]))


def test_mamba2_prefill_in_slices(monkeypatch):
    """A prefill whose decays are built a few chunks at a time equals transformers."""
    monkeypatch.setattr(mamba2, "CHUNK_WORK", 1)
    pair = mamba2_pair(4)
    x = torch.randn(70, pair.shape.hidden_size)
    assert _close(step(pair.ours, [x], pair.state(1), [True])[0], pair.theirs_over([x]))


@pytest.mark.parametrize("mixer", PAIRS)
def test_ablations_fail(mixer, monkeypatch):
    pair = PAIRS[mixer](3)
    x = torch.randn(80, pair.shape.hidden_size)
    want = pair.theirs_over([x[:50], x[50:]])

    def run(fresh_again: bool) -> torch.Tensor:
        state = pair.state(1)
        return torch.cat(step(pair.ours, [x[:50]], state, [True])
                         + step(pair.ours, [x[50:]], state, [fresh_again]))

    assert _close(run(False), want) and not _close(run(True), want)
    if mixer.startswith("deltanet"):
        monkeypatch.setattr(gated_deltanet, "l2_normed", lambda t, eps=1e-6: t)
    else:
        monkeypatch.setattr(pair.ours, "D", torch.zeros_like(pair.ours.D))
    assert not _close(run(False), want)


@pytest.mark.parametrize("mixer", PAIRS)
def test_checkpoints_are_the_states_of_the_prefixes(mixer):
    """A step of three sequences (a 150-token prefill wanting the state after 16, 64, 100 and
    all 150 tokens, a decode wanting it after its token, a 40-token prefill after 3) against
    each prefix run alone from the same starting state."""
    pair = PAIRS[mixer](5)
    hidden = pair.shape.hidden_size
    before = [torch.randn(n, hidden) for n in (0, 20, 30)]
    new = [torch.randn(n, hidden) for n in (150, 1, 40)]
    wanted = ((16, 64, 100, 150), (1,), (3,))

    def started() -> tuple:
        state = pair.state(3)
        step(pair.ours, [b if len(b) else torch.randn(2, hidden) for b in before], state,
             [True] * 3)
        state.conv[0], state.recurrent[0] = 0, 0  # sequence 0 starts fresh in the step
        return state

    state = started()
    outs = step(pair.ours, new, state, [True, False, False], wanted)
    plain = started()
    assert all(_close(a, b) for a, b in zip(outs, step(pair.ours, new, plain, [True, False,
                                                                                 False])))
    got = {(i, o): (conv, rec) for i, o, conv, rec in state.snapshots}
    assert sorted(got) == [(i, o) for i, offsets in enumerate(wanted) for o in offsets]
    for (i, o), (conv, rec) in got.items():
        alone = started()
        step(pair.ours, [new[j][:o] if j == i else new[j][:1] for j in range(3)], alone,
             [True, False, False])
        assert _close(conv, alone.conv[i]) and _close(rec, alone.recurrent[i])


@pytest.mark.parametrize("mixer", ["deltanet", "mamba2"])
def test_held_bytes_are_transformers_parameters(mixer):
    """fp32: the bytes our layer holds are those of transformers' parameters; its projections
    are the ``qkv`` / ``o`` classes' Linears."""
    pair = PAIRS[mixer]()
    assert pair.ours.held_bytes == sum(p.numel() * 4 for p in pair.theirs.parameters())
    assert pair.ours.linears("qkv") == [pair.ours.in_proj]
    assert pair.ours.linears("o") == [pair.ours.out_proj] and pair.ours.linears("down") == []
