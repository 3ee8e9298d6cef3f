"""The preallocated KV tensors of one model: ``[layers, num_blocks, block_size, Hkv, D]`` for K and for V."""

from __future__ import annotations

import torch

from specdec import ops
from specdec.model.config import ModelConfig


class KVPool:
    """``num_kv_heads``: the heads this pool holds (None: the model's; a tensor-parallel rank's share otherwise,
    ``ShardLayout.num_kv_heads``)."""

    def __init__(self, config: ModelConfig, num_blocks: int, block_size: int, dtype: torch.dtype,
                 device: torch.device | str, num_kv_heads: int | None = None):
        heads = num_kv_heads or config.num_key_value_heads
        shape = (config.num_hidden_layers, num_blocks, block_size, heads, config.head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)  # (L, num_blocks, block_size, Hkv, D)
        self.v = torch.zeros(shape, dtype=dtype, device=device)  # (L, num_blocks, block_size, Hkv, D)
        self.num_blocks = num_blocks
        self.block_size = block_size

    @property
    def tensors(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self.k, self.v

    def compact(self, src_slots: torch.Tensor, dst_slots: torch.Tensor) -> None:
        """Move the K/V at flat slots ``src_slots`` (int64 ``[N]``, on the pool's device) to ``dst_slots`` (int64
        ``[N]``, distinct) in every layer, in place (``ops.kv_compact``: every source read before any write)."""
        ops.kv_compact(self.tensors, src_slots, dst_slots)

    @staticmethod
    def bytes_per_block(config: ModelConfig, block_size: int, dtype: torch.dtype,
                        num_kv_heads: int | None = None) -> int:
        """Bytes of one block of this pool: K and V of ``num_kv_heads`` heads (None: the model's; a
        tensor-parallel rank's share otherwise, as in ``__init__``) in every layer."""
        heads = num_kv_heads or config.num_key_value_heads
        per_token = 2 * config.num_hidden_layers * heads * config.head_dim
        return per_token * block_size * torch.tensor([], dtype=dtype).element_size()
