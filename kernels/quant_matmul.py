"""Weight-only quantised matmul ``y = x @ dequant(W).T (+ bias)`` for 1..16 rows (and more), int8 / int4.

The GPU path of ``QuantizedLinear`` (specdec/model/quant/linear.py). The weight formats are those of
specdec/model/quant/formats.py: ``value = q * scale[n, k // GROUP] (+ offset[...])``, int8 ``[N, K]`` or int4 packed
two per byte ``[N, K // 2]`` (column 2j low nibble), fp32 scales / offsets ``[N, K // GROUP]`` (per-channel int8 is
``GROUP == K``).

One program owns ``BLOCK_M`` rows x ``BLOCK_N`` output columns and walks K: every weight tile is read once for all
the rows of the program (a decode step reads the weight once; a k+1-row verification window reads it once too),
dequantised in fp32 and multiplied with ``tl.dot(..., input_precision="ieee")`` (exact fp32 products, fp32
accumulation). The tile sizes never depend on M, so a row's result is the same whether computed alone or with
others (the row-independence speculative decoding needs). ``quant_matmul_reference`` is the torch reference:
dequantise to fp32, matmul in fp32 - the arithmetic of the weight-only scheme, up to the order of the sums.

NOTE: memory-bound at these row counts, so no autotuning (STYLE.md 8): fixed tiles, BLOCK_M = 16 (the smallest
M ``tl.dot`` accepts), BLOCK_N = 64, BLOCK_K = 64 (int8) / 32 (int4). Not yet run on a GPU: interpreter tests
and sm_80 / sm_90 compile checks only (int4 compiles to ~210 registers per thread: no spills, low occupancy).
"""

from __future__ import annotations

import torch

from specdec.kernels._triton import tl, triton

BLOCK_M, BLOCK_N = 16, 64
BLOCK_K = {8: 64, 4: 32}  # int4: 64 spilled on sm_80 / sm_90 (the nibble unpacking's registers); 32 does not


@triton.jit(do_not_specialize=["M"])  # the row count changes every step (decode, k+1 windows)
def _quant_matmul_kernel(
    x_ptr, w_ptr, scale_ptr, offset_ptr, bias_ptr, out_ptr,
    M, N, K,
    stride_xm, stride_wn, stride_sn, stride_om,
    GROUP: tl.constexpr, BITS: tl.constexpr, HAS_OFFSET: tl.constexpr, HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    pid_m = tl.program_id(0).to(tl.int64)
    pid_n = tl.program_id(1).to(tl.int64)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)  # (BLOCK_M,)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)  # (BLOCK_N,)
    m_mask = rm < M
    n_mask = rn < N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)  # (BLOCK_K,)
        k_mask = k < K
        x_mask = m_mask[:, None] & k_mask[None, :]
        x = tl.load(x_ptr + rm[:, None] * stride_xm + k[None, :], mask=x_mask, other=0.0).to(tl.float32)
        w_mask = n_mask[:, None] & k_mask[None, :]  # (BLOCK_N, BLOCK_K)
        if BITS == 8:
            q = tl.load(w_ptr + rn[:, None] * stride_wn + k[None, :], mask=w_mask, other=0).to(tl.float32)
        else:
            byte = tl.load(w_ptr + rn[:, None] * stride_wn + (k // 2)[None, :], mask=w_mask, other=0).to(tl.int32)
            q = ((byte >> ((k % 2) * 4)[None, :]) & 0xF).to(tl.float32)
        s_ptrs = rn[:, None] * stride_sn + (k // GROUP)[None, :]
        w = q * tl.load(scale_ptr + s_ptrs, mask=w_mask, other=0.0)  # (BLOCK_N, BLOCK_K) fp32
        if HAS_OFFSET:
            w = w + tl.load(offset_ptr + s_ptrs, mask=w_mask, other=0.0)
        acc += tl.dot(x, tl.trans(w), input_precision="ieee")  # (BLOCK_M, BLOCK_N)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + rn, mask=n_mask, other=0.0).to(tl.float32)[None, :]
    out_mask = m_mask[:, None] & n_mask[None, :]
    tl.store(out_ptr + rm[:, None] * stride_om + rn[None, :], acc.to(out_ptr.dtype.element_ty), mask=out_mask)


def quant_matmul(x: torch.Tensor, qweight: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor | None,
                 bias: torch.Tensor | None, bits: int) -> torch.Tensor:
    """``x @ dequant(W).T + bias`` (Triton).

    Args:
        x: ``[M, K]`` fp32 / bf16 / fp16, rows contiguous.
        qweight: int8 ``[N, K]`` (bits 8) or uint8 ``[N, K // 2]`` (bits 4, two values per byte), contiguous.
        scale: fp32 ``[N, G]`` with ``K % G == 0`` (group ``K // G``); offset: fp32 ``[N, G]`` or None.
        bias: ``[N]`` or None.
    Returns ``[M, N]`` in ``x``'s dtype (fp32 accumulation). Raises ValueError on bad shapes / dtypes / devices.
    """
    check_quant_matmul_args(x, qweight, scale, offset, bias, bits)
    out = torch.empty((x.shape[0], scale.shape[0]), dtype=x.dtype, device=x.device)
    if x.shape[0] == 0:
        return out
    grid, args, constexprs, num_warps = quant_matmul_launch(x, qweight, scale, offset, bias, out, bits)
    _quant_matmul_kernel[grid](**args, **constexprs, num_warps=num_warps)
    return out


def quant_matmul_launch(x, qweight, scale, offset, bias, out, bits: int) -> tuple[tuple[int, int], dict, dict, int]:
    """``(grid, args, constexprs, num_warps)`` of one launch; works on ``meta`` tensors (the GPU compile test)."""
    m, k = x.shape
    n, groups = scale.shape
    grid = (triton.cdiv(m, BLOCK_M), triton.cdiv(n, BLOCK_N))
    args = {
        "x_ptr": x, "w_ptr": qweight, "scale_ptr": scale,
        "offset_ptr": offset if offset is not None else scale,  # dummies when absent
        "bias_ptr": bias if bias is not None else scale, "out_ptr": out,
        "M": m, "N": n, "K": k,
        "stride_xm": x.stride(0), "stride_wn": qweight.stride(0), "stride_sn": scale.stride(0),
        "stride_om": out.stride(0),
    }  # fmt: skip
    constexprs = {"GROUP": k // groups, "BITS": bits, "HAS_OFFSET": offset is not None, "HAS_BIAS": bias is not None,
                  "BLOCK_M": BLOCK_M, "BLOCK_N": BLOCK_N, "BLOCK_K": BLOCK_K[bits]}  # fmt: skip
    return grid, args, constexprs, 4


def quant_matmul_reference(x: torch.Tensor, qweight: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor | None,
                           bias: torch.Tensor | None, bits: int) -> torch.Tensor:
    """The weight-only arithmetic in torch (same arguments as ``quant_matmul``): dequantise to fp32
    (specdec/model/quant/formats.py), ``x.float() @ W.T`` in fp32, ``+ bias``, cast to ``x``'s dtype.

    NOTE: one row at a time: a CPU GEMM picks its kernel (and so its order of sums) by the number of rows, which
    would make a row's result depend on how many rows came with it (decode vs verification window)."""
    w_t = dequantize(qweight, scale, offset, bits).T  # (K, N) fp32
    x32 = x.float()
    out = torch.cat([x32[i : i + 1] @ w_t for i in range(x32.shape[0])]) if x32.shape[0] else x32 @ w_t  # (M, N)
    if bias is not None:
        out = out + bias.float()
    return out.to(x.dtype)


def unpack_int4(packed: torch.Tensor) -> torch.Tensor:
    """uint8 ``[N, K // 2]`` -> uint8 ``[N, K]`` values in [0, 15] (column 2j from the low nibble, 2j+1 the high)."""
    n, half = packed.shape
    return torch.stack([packed & 0xF, packed >> 4], dim=-1).reshape(n, 2 * half)


def dequantize(q: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor | None, bits: int) -> torch.Tensor:
    """fp32 ``[N, K]`` of a quantised weight (``q`` int8 ``[N, K]`` for 8 bits, packed uint8 ``[N, K // 2]`` for 4;
    ``scale`` / ``offset`` fp32 ``[N, G]``): ``q * scale`` then ``+ offset``, each rounded to fp32 (the order of
    ``gguf.quants``' dequantisation, so kept GGUF blocks dequantise bit-exactly as gguf's do)."""
    values = (unpack_int4(q) if bits == 4 else q).float()  # (N, K)
    n, k = values.shape
    g = k // scale.shape[1]
    w = (values.view(n, -1, g) * scale[..., None].float()).view(n, k)  # (N, K)
    if offset is not None:
        w = (w.view(n, -1, g) + offset[..., None].float()).view(n, k)
    return w


def check_quant_matmul_args(x, qweight, scale, offset, bias, bits: int) -> None:
    """Raise ValueError on anything the kernel would misread."""
    if bits not in (4, 8):
        raise ValueError(f"bits must be 4 or 8, got {bits!r}")
    if x.dim() != 2 or x.stride(1) != 1 or x.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise ValueError(f"x must be a row-contiguous fp32/bf16/fp16 [M, K] tensor, got {x.dtype} {tuple(x.shape)}")
    k = x.shape[1]
    n = scale.shape[0]
    want = (n, k) if bits == 8 else (n, k // 2)
    wdtype = torch.int8 if bits == 8 else torch.uint8
    if tuple(qweight.shape) != want or qweight.dtype != wdtype or not qweight.is_contiguous():
        raise ValueError(f"qweight must be a contiguous {wdtype} {want}, got {qweight.dtype} {tuple(qweight.shape)}")
    if scale.dim() != 2 or scale.dtype != torch.float32 or not scale.is_contiguous() or k % scale.shape[1]:
        raise ValueError(f"scale must be a contiguous fp32 [N, G] with K={k} divisible by G, got {tuple(scale.shape)}")
    if offset is not None and (offset.shape != scale.shape or offset.dtype != torch.float32
                               or not offset.is_contiguous()):
        raise ValueError("offset must be None or a contiguous fp32 tensor shaped like scale")
    if bias is not None and (tuple(bias.shape) != (n,) or not bias.is_contiguous()):
        raise ValueError(f"bias must be None or a contiguous [{n}] tensor")
    tensors = [t for t in (x, qweight, scale, offset, bias) if t is not None]
    if len({t.device for t in tensors}) != 1:
        raise ValueError("x, qweight, scale, offset and bias must be on one device")
