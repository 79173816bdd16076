"""The KV pool's size in blocks, and whether a model's weights and pool fit the memory.

``pool_blocks`` is the engine's rule (``--num-blocks``, else ``--kv-cache-gib``, else
``max_num_seqs`` full-context sequences under a cap); ``kvledger replay`` on ``local`` sizes
its simulated pool with it too. Bytes per block are the ledger's (``engine/kv/layout.py``).
"""

from __future__ import annotations

import torch

from kvledger.engine.config import EngineConfig
from kvledger.engine.kv.layout import resolve_layout
from kvledger.engine.kv.state_store import state_pool_bytes
from kvledger.errors import KVBudgetError
from kvledger.ledger.admission import blocks_for_kv_tokens
from kvledger.ledger.costs import blocks_for
from kvledger.ledger.kv import checkpoint_interval_blocks
from kvledger.ledger.kv_groups import KVGroup, peak_blocks
from kvledger.spec import ModelSpec

DEFAULT_POOL_CAP_BYTES = 1 << 30


def pool_blocks(config: EngineConfig, bytes_per_block: int, max_model_len: int,
                reserved_bytes: int = 0, groups: tuple[KVGroup, ...] = ()) -> int:
    """KV pool size in blocks: ``num_blocks``, else ``kv_cache_gib`` (less ``reserved_bytes``,
    a quantized format's residual blocks) turned into whole blocks, else ``max_num_seqs``
    full-context sequences (in pages of the layer ``groups``, ``kv_groups.peak_blocks``)
    capped at ``DEFAULT_POOL_CAP_BYTES`` (less ``reserved_bytes``).

    Raises:
        KVBudgetError: the pool has no room for one block.
    """
    c = config
    if c.num_blocks is not None:
        blocks = c.num_blocks
    elif c.kv_cache_gib is not None:
        blocks = blocks_for(int(c.kv_cache_gib * (1 << 30)) - reserved_bytes, bytes_per_block)
    else:
        per_seq = (peak_blocks(groups, max_model_len, c.block_size) if groups
                   else blocks_for_kv_tokens(max_model_len, c.block_size))
        blocks = min(per_seq * c.max_num_seqs,
                     blocks_for(DEFAULT_POOL_CAP_BYTES - reserved_bytes, bytes_per_block))
    if blocks < 1:
        raise KVBudgetError(
            f"KV budget too small: one block of {c.block_size} tokens needs "
            f"{bytes_per_block} bytes")
    return blocks


def _checkpoints(config: EngineConfig, spec: ModelSpec, dtype: torch.dtype, blocks: int,
                 layout) -> int:
    """Most state checkpoints a state model's pool of ``blocks`` holds with prefix caching on
    (``engine/kv/state_store.py``; an upper bound: its mixers may take none)."""
    row = state_pool_bytes(spec, 1, dtype)
    if not row or not config.enable_prefix_caching:
        return 0
    return blocks // (config.state_checkpoint_blocks
                      or checkpoint_interval_blocks(row, layout.bytes_per_block))


def check_memory(config: EngineConfig, spec: ModelSpec, dtype: torch.dtype) -> None:
    """Refuse a model whose weights (the ledger's bytes in the compute dtype) and KV pool
    (its blocks times the ledger's bytes per block, plus a quantized format's residual blocks
    and the state slots and checkpoints of a model with state layers) exceed the memory
    available now
    (``MemAvailable``).

    Raises:
        KVBudgetError: they do not fit (the message gives the three figures).
    """
    from kvledger.device.measure import available_memory_bytes
    from kvledger.ledger.params import spec_weight_bytes

    layout = resolve_layout(config, spec, dtype)
    blocks = pool_blocks(config, layout.bytes_per_block, spec.max_position_embeddings,
                         layout.reserved_bytes + state_pool_bytes(spec, config.max_num_seqs,
                                                                  dtype), layout.groups)
    weights = spec_weight_bytes(spec, config.dtype) // config.tensor_parallel_size
    kv = (blocks * layout.bytes_per_block + layout.reserved_bytes
          + state_pool_bytes(spec, config.max_num_seqs + _checkpoints(config, spec, dtype,
                                                                      blocks, layout), dtype))
    available = available_memory_bytes()
    if weights + kv > available:
        gib = 1 << 30
        raise KVBudgetError(
            f"{spec.name} does not fit: its weights take {weights / gib:.2f} GiB in "
            f"{config.dtype} and its KV pool {kv / gib:.2f} GiB, {available / gib:.2f} GiB is "
            "available (lower --kv-cache-gib or --num-blocks, or pick a smaller model)")
