"""How many KV blocks a pool gets: the ``kv_cache_memory_gb`` budget over one block's bytes, capped on CPU by the
memory the weights leave."""

from __future__ import annotations

import logging

import torch

from specdec.cache.kv_pool import KVPool
from specdec.distributed.sharding import ShardLayout
from specdec.memory import available_memory_bytes
from specdec.model.config import ModelConfig

logger = logging.getLogger(__name__)


def kv_pool_blocks(model_config: ModelConfig, block_size: int, dtype: torch.dtype, device: torch.device,
                   kv_cache_memory_gb: float, quantization: str | None = None, tensor_parallel_size: int = 1) -> int:
    """Blocks that ``kv_cache_memory_gb`` buys per rank (before the one-sequence minimum): the budget over one
    block of *this rank's* kv heads (``ShardLayout.num_kv_heads``: ``Hkv / N``, or the one replicated head when
    ``N > Hkv``; every rank holds as many heads, so every rank gets the same count, as the driver's block tables
    need). On CPU the budget is capped at ``kv_pool_room`` shared by the N ranks (they share the host's memory);
    on CUDA each rank's GPU has its own."""
    heads = ShardLayout.of(model_config, 0, tensor_parallel_size).num_kv_heads
    per_block = KVPool.bytes_per_block(model_config, block_size, dtype, heads)
    pool_bytes = int(kv_cache_memory_gb * 2**30)
    room = kv_pool_room(model_config, dtype, device, quantization)
    if device.type == "cpu":
        room //= tensor_parallel_size
    if room < pool_bytes:
        logger.warning("the KV pool is capped at %.2f GB per rank (kv_cache_memory_gb=%s): half of the memory the "
                       "weights leave available, over %d rank(s)", room / 1e9, kv_cache_memory_gb,
                       tensor_parallel_size)
        pool_bytes = room
    return pool_bytes // per_block


def kv_pool_room(model_config: ModelConfig, dtype: torch.dtype, device: torch.device,
                 quantization: str | None = None) -> int:
    """Bytes the KV pool may take on CPU: half of what the memory available now (``MemAvailable``) leaves once the
    weights are loaded (their bytes in ``dtype``), so that ``kv_cache_memory_gb`` never pushes a model that fits
    into swap or the OOM killer. Unbounded on CUDA (the pool is sized in GiB there) or where it is not known."""
    available = available_memory_bytes() if device.type == "cpu" else None
    if available is None:
        return 2**62
    # "gguf": the file's blocks, at most int8 with its scales (Q8_0, Q6_K) - a bound
    per_param = {"int8": 1.0, "int4": 0.75, "gguf": 1.25}.get(quantization,
                                                               torch.empty((), dtype=dtype).element_size())
    weights = int(model_config.num_params * per_param)  # quantised: ~ the linears' bytes (a bound, not exact)
    return max(0, (available - weights) // 2)
