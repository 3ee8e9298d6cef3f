"""GGUF block-quantised tensors read straight into the formats of specdec/model/quant/formats.py, unchanged.

Exact mappings (along the input dimension; fp16 scales, and their products with the K-quants' 6- or 8-bit
sub-block scales, held exactly in fp32):
- Q8_0 (d, int8 q[32]):          value = q * d               -> int8, group 32, scale d.
- Q5_0 (d, 5-bit q[32]):         value = (q - 16) * d        -> int8, group 32, scale d (q - 16 in [-16, 15]).
- Q6_K (256: d, int8 sc[16], 6-bit q): value = d * sc * (q - 32) -> int8, group 16, scale d * sc.
- Q5_1 (d, m, 5-bit q[32]):      value = q * d + m           -> int8, group 32, scale d, offset m.
- Q5_K (256: d, dmin, 6-bit sc[8] and m[8], 5-bit q): value = d * sc * q - dmin * m
                                                             -> int8, group 32, scale d * sc, offset -(dmin * m).
- Q4_0 (d, nibbles):             value = (q - 8) * d         -> int4, group 32, scale d, offset -8 d.
- Q4_1 (d, m, nibbles):          value = q * d + m           -> int4, group 32, scale d, offset m.
- Q4_K (256: d, dmin, 6-bit sc[8] and m[8], nibbles): value = d * sc * q - dmin * m
                                                             -> int4, group 32, scale d * sc, offset -(dmin * m).
Each dequantises (``formats.dequantize``: one product, one add, in fp32) to what ``gguf.quants`` gives, bit for bit.
In a Q4_0 / Q4_1 / Q5_0 block, byte j holds element j (low nibble) and element j + 16 (high nibble); our int4
packing is adjacent pairs. Other types (Q2_K, Q3_K, IQ*, ...) map onto none of our formats: the loader
quantises their dequantised values again (``quantization`` int4 / int8) or keeps them dense (``"gguf"``).

``quantization="int4"`` / ``"int8"`` (group 32) keep the types of ``KEPT_BY_SCHEME`` - those whose values and scale
format are the scheme's own; ``quantization="gguf"`` keeps every type of ``KEPT`` in its own format.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from specdec.model.quant.formats import pack_int4

BLOCK = 32  # Q4_0 / Q4_1 / Q5_0 / Q8_0 block; a K-quant super-block is 256
QK_K = 256


@dataclass(frozen=True)
class BlockLayout:
    """A GGUF type's block in the file: ``block_bytes`` bytes holding ``block_elems`` values (the mapping onto our
    formats is the module docstring's)."""

    block_bytes: int
    block_elems: int


KEPT = {
    "Q8_0": BlockLayout(34, 32),
    "Q5_0": BlockLayout(22, 32),
    "Q6_K": BlockLayout(210, QK_K),
    "Q5_1": BlockLayout(24, 32),
    "Q5_K": BlockLayout(176, QK_K),
    "Q4_0": BlockLayout(18, 32),
    "Q4_1": BlockLayout(20, 32),
    "Q4_K": BlockLayout(144, QK_K),
}
KEPT_BY_SCHEME = {"int8": ("Q8_0",), "int4": ("Q4_0", "Q4_1")}  # what quantization int8 / int4 (group 32) keep


def kept_scheme(type_name: str) -> str | None:
    """The scheme ("int8" / "int4", group 32) a GGUF type is kept under exactly, or None."""
    return next((scheme for scheme, types in KEPT_BY_SCHEME.items() if type_name in types), None)


def kept_as_stored(type_name: str) -> bool:
    """Whether ``quantization="gguf"`` holds a GGUF type as stored (else the linear is kept dense)."""
    return type_name in KEPT


def _f16(raw: np.ndarray) -> torch.Tensor:
    """uint8 ``[..., 2]`` little-endian fp16 -> fp32 ``[...]`` (exact)."""
    return torch.from_numpy(raw.copy().view(np.float16)[..., 0].astype(np.float32))


def read_blocks(tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """A ``KEPT`` type's ``gguf`` ReaderTensor as ``(q, scale, offset)`` in torch layout ``[out, in]``: int8 ``[N, K]``
    or packed uint8 ``[N, K // 2]`` (int4), fp32 ``[N, K // group]`` scales and offsets (None for Q8_0 / Q5_0 /
    Q6_K)."""
    type_name = tensor.tensor_type.name
    kind = KEPT[type_name]
    k, n = (int(d) for d in tensor.shape)  # GGUF shapes are [in, out]
    blocks = np.asarray(tensor.data).reshape(n, k // kind.block_elems, kind.block_bytes)  # (N, B, bytes)
    if type_name == "Q4_K":
        return _read_q4_k(blocks, n, k)
    if type_name == "Q6_K":
        return _read_q6_k(blocks, n, k)
    if type_name == "Q5_K":
        return _read_q5_k(blocks, n, k)
    d = _f16(blocks[..., 0:2])  # (N, G)
    if type_name == "Q8_0":
        q = torch.from_numpy(blocks[..., 2:].copy().view(np.int8)).reshape(n, k)  # (N, K)
        return q, d.contiguous(), None
    if type_name in ("Q5_0", "Q5_1"):
        at = 2 if type_name == "Q5_0" else 4  # Q5_1: d, m, then the high bits
        high = torch.from_numpy(blocks[..., at : at + 4].copy().view("<u4").astype(np.int64))  # (N, G, 1) bit j: j
        nib = torch.from_numpy(blocks[..., at + 4 :].copy()).long()  # (N, G, 16)
        low = torch.cat([nib & 0xF, nib >> 4], dim=-1)  # (N, G, 32)
        bits = (high >> torch.arange(32)) & 1  # (N, G, 32)
        q = low | (bits << 4)  # (N, G, 32) in [0, 31]
        if type_name == "Q5_0":
            return (q - 16).to(torch.int8).reshape(n, k), d.contiguous(), None  # in [-16, 15]
        return q.to(torch.int8).reshape(n, k), d.contiguous(), _f16(blocks[..., 2:4]).contiguous()
    if type_name == "Q4_1":
        offset = _f16(blocks[..., 2:4])
        nibbles = blocks[..., 4:]
    else:
        offset = -8 * d
        nibbles = blocks[..., 2:]
    nib = torch.from_numpy(nibbles.copy())  # (N, G, 16)
    q = torch.cat([nib & 0xF, nib >> 4], dim=-1).reshape(n, k)  # (N, K): elements 0..15 then 16..31 per block
    return pack_int4(q), d.contiguous(), offset.contiguous()


def _read_q4_k(blocks: np.ndarray, n: int, k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Q4_K super-blocks (N, S, 144) -> int4 group 32: scale d * sc, offset -(dmin * m) (fp32 products, exact)."""
    scale, offset = _k_scales(blocks, n, k)
    qs = torch.from_numpy(blocks[..., 16:].copy()).reshape(n, -1, 4, 32)  # (N, S, 4, 32): sub-blocks 2j, 2j+1
    q = torch.stack([qs & 0xF, qs >> 4], dim=3).reshape(n, k)  # (N, K)
    return pack_int4(q), scale, offset


def _k_scales(blocks: np.ndarray, n: int, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_K / Q5_K super-blocks' (N, S, ...) scales and offsets per 32: d * sc and -(dmin * m) (fp32, exact)."""
    d, dmin = _f16(blocks[..., 0:2]), _f16(blocks[..., 2:4])  # (N, S)
    sc_raw = torch.from_numpy(blocks[..., 4:16].copy()).long().reshape(n, -1, 3, 4)  # (N, S, 3, 4)
    lo, mid, top = sc_raw[..., 0, :], sc_raw[..., 1, :], sc_raw[..., 2, :]  # 6-bit sc / m packed in 12 bytes
    sc = torch.cat([lo & 0x3F, (top & 0x0F) | ((lo >> 2) & 0x30)], dim=-1)  # (N, S, 8)
    m = torch.cat([mid & 0x3F, (top >> 4) | ((mid >> 2) & 0x30)], dim=-1)  # (N, S, 8)
    scale = (d[..., None] * sc.float()).reshape(n, k // BLOCK)  # (N, G) fp32: exact (11 x 6 bits)
    offset = -(dmin[..., None] * m.float()).reshape(n, k // BLOCK)
    return scale.contiguous(), offset.contiguous()


def _read_q5_k(blocks: np.ndarray, n: int, k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Q5_K super-blocks (N, S, 176) -> int8 group 32 in [0, 31]: scale d * sc, offset -(dmin * m)."""
    scale, offset = _k_scales(blocks, n, k)
    qh = torch.from_numpy(blocks[..., 16:48].copy()).long().reshape(n, -1, 1, 32)  # bit j of byte l: sub-block j
    qs = torch.from_numpy(blocks[..., 48:].copy()).long().reshape(n, -1, 4, 32)  # (N, S, 4, 32)
    low = torch.stack([qs & 0xF, qs >> 4], dim=3).reshape(n, -1, 8, 32)  # sub-block 2j, 2j + 1 from chunk j
    high = (qh >> torch.arange(8).reshape(1, 1, 8, 1)) & 1  # (N, S, 8, 32)
    return (low | (high << 4)).to(torch.int8).reshape(n, k), scale, offset


def _read_q6_k(blocks: np.ndarray, n: int, k: int) -> tuple[torch.Tensor, torch.Tensor, None]:
    """Q6_K super-blocks (N, S, 210) -> int8 group 16: q - 32 in [-32, 31], scale d * sc (fp32, exact)."""
    s = blocks.shape[1]
    ql = torch.from_numpy(blocks[..., 0:128].copy()).reshape(n, s, 2, 1, 64)  # two halves of 128 elements
    qh = torch.from_numpy(blocks[..., 128:192].copy()).reshape(n, s, 2, 1, 32)
    sc = torch.from_numpy(blocks[..., 192:208].copy().view(np.int8)).float()  # (N, S, 16)
    d = _f16(blocks[..., 208:210])  # (N, S)
    low = (ql >> torch.tensor([0, 4], dtype=torch.uint8).reshape(1, 1, 1, 2, 1)) & 0xF  # (N, S, 2, 2, 64)
    low = low.reshape(n, s, 2, 4, 32)  # per half: elements 0-31, 32-63 (low nibbles), 64-95, 96-127 (high)
    high = (qh >> torch.tensor([0, 2, 4, 6], dtype=torch.uint8).reshape(1, 1, 1, 4, 1)) & 0x3  # (N, S, 2, 4, 32)
    q = (low.long() | (high.long() << 4)) - 32  # (N, S, 2, 4, 32)
    scale = (d[..., None] * sc).reshape(n, k // 16)  # (N, G) fp32: exact (11 x 8 bits)
    return q.to(torch.int8).reshape(n, k), scale.contiguous(), None


def unpermute_rows(t: torch.Tensor | None, n_head: int) -> torch.Tensor | None:
    """Undo llama.cpp's rope row permutation on any per-row tensor ``[out, ...]`` (q, scales, offsets alike)."""
    if t is None:
        return None
    head_dim = t.shape[0] // n_head
    return t.reshape(n_head, head_dim // 2, 2, *t.shape[1:]).transpose(1, 2).reshape(t.shape).contiguous()
