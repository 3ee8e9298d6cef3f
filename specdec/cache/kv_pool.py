"""The preallocated KV tensors of one model: ``[layers, num_blocks, block_size, Hkv, D]`` for K and for V."""

from __future__ import annotations

import torch

from specdec.model.config import ModelConfig


class KVPool:
    def __init__(self, config: ModelConfig, num_blocks: int, block_size: int, dtype: torch.dtype,
                 device: torch.device | str):
        shape = (config.num_hidden_layers, num_blocks, block_size, config.num_key_value_heads, config.head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)  # (L, num_blocks, block_size, Hkv, D)
        self.v = torch.zeros(shape, dtype=dtype, device=device)  # (L, num_blocks, block_size, Hkv, D)
        self.num_blocks = num_blocks
        self.block_size = block_size

    @property
    def tensors(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self.k, self.v

    @staticmethod
    def bytes_per_block(config: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
        per_token = 2 * config.num_hidden_layers * config.num_key_value_heads * config.head_dim
        return per_token * block_size * torch.tensor([], dtype=dtype).element_size()
