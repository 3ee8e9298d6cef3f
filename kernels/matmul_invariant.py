"""A batch-invariant GEMM for CUDA: ``y = x @ W^T (+ bias)`` with one launch configuration for every row count.

cuBLAS (``F.linear``) picks its algorithm - tile shape, split-K - by the problem's shape, so a row's output changes
with the number of rows in the call: a verification window (k+1 rows) rounds differently from a decode (1 row). This
kernel's configuration (``INVARIANT_CONFIG``: tile sizes, warps, stages) is fixed and its K loop runs in order in one
program with no split, so row m of the result is computed by the same instructions whatever M is: what
``LLM(batch_invariant=True)`` needs on a GPU (docs/guarantees.md). The row count is never specialised on (it is a
``do_not_specialize`` argument), so every M runs the same binary.

Not yet run on a GPU: its speed against cuBLAS is unmeasured, which is why the invariant mode is opt-in on CUDA.
Interpreter tests check it against ``matmul_invariant_reference`` and that rows do not depend on M; the sm_80 /
sm_90 compile test checks registers and spills.
"""

from __future__ import annotations

import torch

from specdec.kernels._triton import tl, triton

# One configuration for every M (the point of the kernel): 16-row tiles keep a decode's waste small; 64 columns and
# 64 inputs per step give tl.dot full MMA shapes in bf16 / fp16.
INVARIANT_CONFIG = {"BLOCK_M": 16, "BLOCK_N": 64, "BLOCK_K": 64, "num_warps": 4, "num_stages": 3}
_INTERPRETED = triton is not None and __import__("os").environ.get("TRITON_INTERPRET") == "1"


@triton.jit(do_not_specialize=["m_rows"])
def _matmul_kernel(
    x_ptr,  # [M, K] model dtype, unit column stride
    w_ptr,  # [N, K] model dtype, unit column stride
    bias_ptr,  # [N] (unused without HAS_BIAS)
    out_ptr,  # [M, N] model dtype, contiguous
    m_rows, n_cols, k_dim,
    stride_xm, stride_wn,
    HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    DOT_F32: tl.constexpr,  # upcast to fp32 before tl.dot (the interpreter's bf16 dot is wrong)
    DOT_PRECISION: tl.constexpr,  # "ieee" for fp32 operands (never tf32), None for bf16 / fp16
):
    pid_m = tl.program_id(0).to(tl.int64)
    pid_n = tl.program_id(1).to(tl.int64)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    ks = tl.arange(0, BLOCK_K)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, k_dim, BLOCK_K):  # in order, in this program: no split-K
        kk = k0 + ks
        a = tl.load(x_ptr + rows[:, None] * stride_xm + kk[None, :], mask=(rows[:, None] < m_rows)
                    & (kk[None, :] < k_dim), other=0.0)
        b = tl.load(w_ptr + cols[None, :] * stride_wn + kk[:, None], mask=(cols[None, :] < n_cols)
                    & (kk[:, None] < k_dim), other=0.0)  # [BLOCK_K, BLOCK_N]: W^T's tile
        if DOT_F32:
            a = a.to(tl.float32)
            b = b.to(tl.float32)
        acc = tl.dot(a, b, acc, input_precision=DOT_PRECISION)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + cols, mask=cols < n_cols, other=0.0).to(tl.float32)[None, :]
    out = out_ptr + rows[:, None] * n_cols + cols[None, :]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=(rows[:, None] < m_rows) & (cols[None, :] < n_cols))


def matmul_plan(m_rows: int, n_cols: int, dtype: torch.dtype, interpret: bool | None = None) -> dict:
    """The launch of an ``[M, K] x [N, K]^T`` product: grid and every constexpr / launch option. Only the grid's
    first dimension depends on M (tested): that is the invariance."""
    cfg = dict(INVARIANT_CONFIG)
    dot_f32 = (_INTERPRETED if interpret is None else interpret) and dtype == torch.bfloat16
    return {"grid": (triton.cdiv(m_rows, cfg["BLOCK_M"]), triton.cdiv(n_cols, cfg["BLOCK_N"])),
            "constexprs": {"BLOCK_M": cfg["BLOCK_M"], "BLOCK_N": cfg["BLOCK_N"], "BLOCK_K": cfg["BLOCK_K"],
                           "DOT_F32": dot_f32,
                           "DOT_PRECISION": "ieee" if dtype == torch.float32 or dot_f32 else None},
            "num_warps": cfg["num_warps"], "num_stages": cfg["num_stages"]}


def matmul_invariant(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x [M, K] @ weight [N, K]^T (+ bias [N])`` in x's dtype (fp32 accumulation), row-invariant.

    Args:
        x: ``[M, K]`` fp32 / fp16 / bf16 with unit column stride. weight: ``[N, K]``, same dtype and device, unit
        column stride. bias: optional ``[N]``.
    Returns:
        ``[M, N]`` contiguous, x's dtype.
    """
    if x.ndim != 2 or weight.ndim != 2 or x.shape[1] != weight.shape[1]:
        raise ValueError(f"x must be [M, K] and weight [N, K]; got {tuple(x.shape)} and {tuple(weight.shape)}")
    if x.dtype not in (torch.float32, torch.float16, torch.bfloat16) or weight.dtype != x.dtype:
        raise ValueError(f"x and weight must share a dtype among fp32/fp16/bf16; got {x.dtype}, {weight.dtype}")
    if x.shape[1] > 1 and (x.stride(1) != 1 or weight.stride(1) != 1):
        raise ValueError("x and weight must have unit column stride (call .contiguous())")
    m_rows, k_dim = x.shape
    n_cols = weight.shape[0]
    out = torch.empty((m_rows, n_cols), dtype=x.dtype, device=x.device)
    if m_rows == 0 or n_cols == 0:
        return out
    plan = matmul_plan(m_rows, n_cols, x.dtype)
    _matmul_kernel[plan["grid"]](
        x, weight, bias if bias is not None else x, out, m_rows, n_cols, k_dim, x.stride(0), weight.stride(0),
        HAS_BIAS=bias is not None, **plan["constexprs"], num_warps=plan["num_warps"],
        num_stages=plan["num_stages"])
    return out


def matmul_invariant_reference(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
                               ) -> torch.Tensor:
    """The product in fp32 (then x's dtype): the oracle of :func:`matmul_invariant` up to fp32 summation order."""
    out = x.float() @ weight.float().T
    if bias is not None:
        out = out + bias.float()
    return out.to(x.dtype)
