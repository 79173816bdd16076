"""LatentStore: the paged pool of multi-head latent attention (DeepSeek-V2, arXiv:2405.04434 §2.1).

An MLA layer caches one entry per token, ``kv_a_layernorm(c_KV)`` (``kv_lora_rank`` values) then
the roped ``k_pe`` (``qk_rope_head_dim`` values), shared by every head: one tensor per layer of
``[num_blocks, block_size, 1, kv_lora_rank + qk_rope_head_dim]``. The absorbed attention
(``model/layers/latent_attention.py``) reads it as the keys of one KV head and its leading
``kv_lora_rank`` values as the values, so the store hands out the same tensor for both: ``key_blocks[layer] is
value_blocks[layer]``, written once per token, read once per step. It holds exactly
``num_blocks * ledger.kv_bytes_per_block`` bytes, ``(kv_lora_rank + qk_rope_head_dim) x layers
x element bytes`` per token slot.
"""

from __future__ import annotations

import torch

from kvledger.engine.kv.store import KVStore, lazy_zeros


class LatentStore(KVStore):
    """Per-layer latent block tensors, read as K and V alike (module docstring).

    Args:
        num_layers, num_blocks, block_size: shape of the pool; latent_dim: ``kv_lora_rank +
        qk_rope_head_dim``; dtype, compute_dtype: as :class:`KVStore`.
    """

    def __init__(self, num_layers: int, num_blocks: int, block_size: int, latent_dim: int,
                 dtype: torch.dtype, compute_dtype: torch.dtype | None = None) -> None:
        super().__init__(num_layers, 0, block_size, 1, latent_dim, dtype, compute_dtype)
        self.num_blocks = num_blocks
        self.key_blocks = [lazy_zeros((num_blocks, block_size, 1, latent_dim), dtype)
                           for _ in range(num_layers)]
        self.value_blocks = self.key_blocks
        self._keys = [t.view(num_blocks * block_size, 1, latent_dim) for t in self.key_blocks]
        self._values = self._keys

    def write(self, layer: int, slot_mapping: torch.Tensor, key: torch.Tensor,
              value: torch.Tensor, seal: torch.Tensor | None = None) -> None:
        """Store new tokens' entries ``key`` [tokens, 1, latent_dim] (``value`` is ``key``; as
        in :meth:`KVStore.write`, a full-precision entry is final as written)."""
        self._keys[layer].index_copy_(0, slot_mapping, key.to(self._keys[layer].dtype))

    def gather(self, layer: int, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The entries at ``slots`` (shape S) -> S + [1, latent_dim], as keys and values."""
        rows = torch.index_select(self._keys[layer], 0, slots.reshape(-1))
        rows = rows.to(self.compute_dtype).view(*slots.shape, *rows.shape[1:])
        return rows, rows

    def read_blocks(self, layer: int, block_ids: torch.Tensor
                    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The entries of blocks ``block_ids`` (shape S) -> S + [block_size, 1, latent_dim]."""
        rows = torch.index_select(self.key_blocks[layer], 0, block_ids.reshape(-1))
        rows = rows.view(*block_ids.shape, *rows.shape[1:])
        return rows, rows

    def copy_head_slots(self, rows, src, dst) -> None:
        raise NotImplementedError("per-head retention does not run on MLA (refused at start)")
