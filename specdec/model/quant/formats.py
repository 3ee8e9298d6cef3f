"""Weight-only quantised formats: per-channel / group-wise int8 and group-wise int4, and their dequantisation.

One representation for both widths, the one the torch reference, the CPU paths and the Triton kernel read:

    value[n, k] = q[n, k] * scale[n, k // group_size] (+ offset[n, k // group_size])

- int8: ``q`` int8 ``[N, K]`` symmetric in [-127, 127], ``scale`` fp32 ``[N, K // group_size]``, no offset.
  Per-channel is ``group_size == K`` (one scale per output row).
- int4: ``q`` in [0, 15], two per byte (uint8 ``[N, K // 2]``: column 2j in the low nibble, 2j+1 in the high one),
  ``scale`` and ``offset`` fp32 ``[N, K // group_size]`` (asymmetric, min/max per group: GGUF Q4_1's form; Q4_0's
  ``(q - 8) * d`` is ``scale = d, offset = -8 d``, both exact in fp32).

Scales are fp32 so that GGUF's fp16 block scales are held exactly. The dequantisation multiplies then adds, each
rounded to fp32 - the same two operations, in the same order, as ``gguf.quants`` (so kept GGUF tensors dequantise
bit-exactly to what gguf gives).
"""

from __future__ import annotations

import torch

from specdec.kernels.quant_matmul import dequantize, unpack_int4  # noqa: F401 (re-exported: the kernel's reference)

BITS = {"int8": 8, "int4": 4}
INT8_MAX = 127
INT4_MAX = 15


def quantize_int8(w: torch.Tensor, group_size: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric int8 of ``w [N, K]`` (any float dtype, read as fp32): per output channel (``group_size`` None) or
    per group of ``group_size`` input columns. Returns ``q`` int8 ``[N, K]`` and ``scale`` fp32 ``[N, G]``
    (G = 1 per-channel, else K // group_size); an all-zero group gets scale 1."""
    n, k = w.shape
    g = k if group_size is None else group_size
    _check_groups(k, g)
    w32 = w.float().reshape(n, k // g, g)  # (N, G, g)
    amax = w32.abs().amax(-1)  # (N, G)
    scale = torch.where(amax > 0, amax / INT8_MAX, torch.ones_like(amax))
    q = torch.round(w32 / scale[..., None]).clamp_(-INT8_MAX, INT8_MAX).to(torch.int8)
    return q.reshape(n, k), scale


def quantize_int4(w: torch.Tensor, group_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Asymmetric int4 of ``w [N, K]`` per group of ``group_size`` input columns (min/max: ``offset`` = the group's
    minimum, ``scale`` = range / 15). Returns packed ``q`` uint8 ``[N, K // 2]``, ``scale`` and ``offset`` fp32
    ``[N, K // group_size]``; a constant group gets scale 1."""
    n, k = w.shape
    _check_groups(k, group_size)
    if group_size % 2:
        raise ValueError(f"int4 group_size must be even (two values per byte), got {group_size}")
    w32 = w.float().reshape(n, k // group_size, group_size)  # (N, G, g)
    lo, hi = w32.amin(-1), w32.amax(-1)  # (N, G)
    scale = torch.where(hi > lo, (hi - lo) / INT4_MAX, torch.ones_like(lo))
    q = torch.round((w32 - lo[..., None]) / scale[..., None]).clamp_(0, INT4_MAX).to(torch.uint8)
    return pack_int4(q.reshape(n, k)), scale, lo


def pack_int4(q: torch.Tensor) -> torch.Tensor:
    """uint8 ``[N, K]`` values in [0, 15] -> uint8 ``[N, K // 2]`` (even column low nibble, odd column high)."""
    q = q.to(torch.uint8)
    return q[:, 0::2] | (q[:, 1::2] << 4)


def _check_groups(k: int, group_size: int) -> None:
    if not isinstance(group_size, int) or isinstance(group_size, bool) or group_size < 1 or k % group_size:
        raise ValueError(f"group_size must be a positive integer dividing the input width {k}, got {group_size!r}")
