"""The window-aware figure of a sliding layer in whole blocks (issue 34 item 6): the blocks
covering the positions the next queries can still see (query i sees key j when i - j < W),
counted here from that definition position by position."""

from __future__ import annotations

import pytest

from kvledger.ledger.kv import kv_bytes_per_sequence, layer_block_bytes
from kvledger.ledger.kv_format import KVFormatSpec
from kvledger.ledger.kv_groups import window_blocks
from kvledger.spec import FULL, SLIDING

BF16 = KVFormatSpec("bf16")


def _visible_blocks(tokens: int, window: int, block: int, new: int) -> int:
    """Blocks of the keys some query sees: between steps the next query (position t) over the
    t stored keys, during a chunk each of its queries t .. t + C - 1 over the keys before it."""
    queries = range(tokens, tokens + new) if new else [tokens]
    keys = {j for i in queries for j in range(i + 1 if new else tokens) if i - j < window}
    return len({j // block for j in keys})


@pytest.mark.parametrize("window", [1, 2, 5, 16, 17, 40])
@pytest.mark.parametrize("block", [1, 4, 16])
@pytest.mark.parametrize("new", [0, 1, 3, 16])
def test_window_blocks_are_the_blocks_the_next_queries_see(window, block, new):
    for tokens in range(3 * window + 2 * block + 3):
        assert window_blocks(tokens, window, block, new) == _visible_blocks(
            tokens, window, block, new), (tokens, window, block, new)


def test_a_window_off_the_block_grid_holds_one_block_more_than_min_t_w():
    # W = 512, B = 16 at t = 520: positions 9 .. 519 lie in blocks 0 .. 32 (ceil(512/16) = 32)
    assert window_blocks(520, 512, 16) == 33
    assert window_blocks(512, 512, 16) == 32  # positions 1 .. 511
    # a chunk of 64 from t = 520: positions 9 .. 583, W + C - 1 = 575 of them
    assert window_blocks(520, 512, 16, 64) == 583 // 16 + 1


def test_gemma3_1b_at_8192_against_all_global_layers(real_spec):
    """Issue 34: (4 x 8,192 + 22 x 512) / (26 x 8,192) ~ 0.21, exactly in whole blocks:
    4 global layers hold 8192 / 16 = 512 blocks, 22 sliding ones positions 7,681 .. 8,191,
    blocks 480 .. 511, 32 each."""
    spec = real_spec("google__gemma-3-1b-it")
    assert spec.layers.types.count(SLIDING) == 22 and spec.layers.types.count(FULL) == 4
    assert spec.layers.sliding_window == 512
    block = layer_block_bytes(spec, BF16, 1, 16, FULL)
    assert layer_block_bytes(spec, BF16, 1, 16, SLIDING) == block
    hybrid = kv_bytes_per_sequence(spec, BF16, 1, 16, 8192, window_aware=True, paged=True)
    global_ = kv_bytes_per_sequence(spec, BF16, 1, 16, 8192, window_aware=False, paged=True)
    assert hybrid == (4 * 512 + 22 * 32) * block and global_ == 26 * 512 * block
    assert hybrid / global_ == 2752 / 13312 and round(hybrid / global_, 2) == 0.21
