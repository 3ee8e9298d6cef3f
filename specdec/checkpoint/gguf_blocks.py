"""GGUF Q4_0 / Q4_1 / Q8_0 tensors read straight into the formats of specdec/model/quant/formats.py, unchanged.

Exact mappings (32-element blocks along the input dimension, fp16 scales held exactly in fp32):
- Q8_0 (d, int8 q[32]): value = q * d            -> int8, group 32, scale d.
- Q4_0 (d, nibbles):    value = (q - 8) * d      -> int4, group 32, scale d, offset -8 d (exact: a power-of-2 scaling).
- Q4_1 (d, m, nibbles): value = q * d + m        -> int4, group 32, scale d, offset m.
In a block, byte j holds element j (low nibble) and element j + 16 (high nibble); our packing is adjacent pairs.
Every other type (Q4_K, Q5_*, Q6_K, ...) is not kept: the loader quantises its dequantised values again.
"""

from __future__ import annotations

import numpy as np
import torch

from specdec.model.quant.formats import pack_int4

BLOCK = 32
KEPT = {"Q8_0": ("int8", 34), "Q4_0": ("int4", 18), "Q4_1": ("int4", 20)}  # type -> (scheme, bytes per block)


def kept_scheme(type_name: str) -> str | None:
    """The scheme a GGUF type maps onto exactly (with group 32), or None."""
    return KEPT[type_name][0] if type_name in KEPT else None


def read_blocks(tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """A Q4_0 / Q4_1 / Q8_0 ``gguf`` ReaderTensor as ``(q, scale, offset)`` in torch layout ``[out, in]``:
    int8 ``[N, K]`` or packed uint8 ``[N, K // 2]``, fp32 ``[N, K // 32]`` scales (and offsets for int4)."""
    type_name = tensor.tensor_type.name
    scheme, block_bytes = KEPT[type_name]
    k, n = (int(d) for d in tensor.shape)  # GGUF shapes are [in, out]
    blocks = np.asarray(tensor.data).reshape(n, k // BLOCK, block_bytes)  # (N, G, bytes)
    d = torch.from_numpy(blocks[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32))  # (N, G)
    if type_name == "Q8_0":
        q = torch.from_numpy(blocks[..., 2:].copy().view(np.int8)).reshape(n, k)  # (N, K)
        return q, d.contiguous(), None
    if type_name == "Q4_1":
        offset = torch.from_numpy(blocks[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32))
        nibbles = blocks[..., 4:]
    else:
        offset = -8 * d
        nibbles = blocks[..., 2:]
    nib = torch.from_numpy(nibbles.copy())  # (N, G, 16)
    q = torch.cat([nib & 0xF, nib >> 4], dim=-1).reshape(n, k)  # (N, K): elements 0..15 then 16..31 per block
    return pack_int4(q), d.contiguous(), offset.contiguous()


def unpermute_rows(t: torch.Tensor | None, n_head: int) -> torch.Tensor | None:
    """Undo llama.cpp's rope row permutation on any per-row tensor ``[out, ...]`` (q, scales, offsets alike)."""
    if t is None:
        return None
    head_dim = t.shape[0] // n_head
    return t.reshape(n_head, head_dim // 2, 2, *t.shape[1:]).transpose(1, 2).reshape(t.shape).contiguous()
