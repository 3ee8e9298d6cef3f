"""RMSNorm, optionally fused with the residual add before it: one read of each row, one write of each output.

A decoder layer of the unfused forward runs, per norm, a residual add, a cast, a square, a mean, an rsqrt, two
multiplies and a cast back: eight small kernels of 1-5 us each on a GPU (the H100 profile of
bench/results/gpu_h100_20261126 spent ~45% of a round's GPU time in such kernels). Here it is one program per row:

    residual = x + residual            (rounded to the model dtype, stored: the residual stream)
    out      = weight * to_dtype(residual * rsqrt(mean(residual^2) + eps))

The rounding steps are the torch reference's (``rms_norm_reference``, the CPU path and the oracle): the add is
rounded to the model dtype before it is normalised, the normalised row is rounded before the weight multiply, and
the product is rounded again - so the kernel differs from the reference only in the order of the mean's sum and in
``rsqrt`` (a few ulp in fp32, at most one bf16 ulp here and there). Math in fp32 after an exact upcast.
"""

from __future__ import annotations

import torch

from specdec.kernels._triton import tl, triton

MAX_HIDDEN = 16384  # one program holds a whole row in registers (Llama-3 70B: 8192)


def rms_norm_config(hidden: int) -> tuple[int, int]:
    """``(BLOCK, num_warps)`` for rows of ``hidden`` elements; ``ValueError`` on rows too long for one program."""
    if not 1 <= hidden <= MAX_HIDDEN:
        raise ValueError(f"rms_norm supports 1 <= hidden <= {MAX_HIDDEN}, got {hidden}")
    block = triton.next_power_of_2(hidden)
    return block, 4 if block <= 1024 else 8 if block <= 4096 else 16


@triton.jit
def _fused_add_rms_norm_kernel(
    x_ptr,  # [T, H] model dtype, unit column stride
    residual_ptr,  # [T, H] model dtype: read and overwritten with x + residual (HAS_RESIDUAL only)
    weight_ptr,  # [H] model dtype
    out_ptr,  # [T, H] model dtype, contiguous
    hidden,
    x_row_stride,
    residual_row_stride,
    eps,
    HAS_RESIDUAL: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < hidden
    dtype = out_ptr.dtype.element_ty
    x = tl.load(x_ptr + row * x_row_stride + cols, mask=mask, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:
        r = tl.load(residual_ptr + row * residual_row_stride + cols, mask=mask, other=0.0).to(tl.float32)
        stream = (x + r).to(dtype)  # the residual stream, rounded as the reference's add rounds it
        tl.store(residual_ptr + row * residual_row_stride + cols, stream, mask=mask)
        x = stream.to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / hidden + eps)
    normed = (x * rstd).to(dtype).to(tl.float32)
    w = tl.load(weight_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * hidden + cols, (w * normed).to(dtype), mask=mask)


def _check(x: torch.Tensor, weight: torch.Tensor, residual: torch.Tensor | None) -> None:
    if x.ndim != 2:
        raise ValueError(f"x must be [T, hidden], got shape {tuple(x.shape)}")
    if x.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        raise ValueError(f"x must be fp32/fp16/bf16, got {x.dtype}")
    if x.shape[1] > 1 and x.stride(1) != 1:
        raise ValueError("x must have unit column stride (call .contiguous())")
    if (weight.shape != (x.shape[1],) or weight.dtype != x.dtype or weight.device != x.device
            or not weight.is_contiguous()):
        raise ValueError(f"weight must be a contiguous {x.dtype} [{x.shape[1]}] on {x.device}, got {weight.dtype} "
                         f"{tuple(weight.shape)} on {weight.device}")
    if residual is not None:
        if residual.shape != x.shape or residual.dtype != x.dtype or residual.device != x.device:
            raise ValueError(f"residual must match x ({x.dtype} {tuple(x.shape)} on {x.device}), got "
                             f"{residual.dtype} {tuple(residual.shape)} on {residual.device}")
        if x.shape[1] > 1 and residual.stride(1) != 1:
            raise ValueError("residual must have unit column stride")


def fused_add_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
                       residual: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton RMSNorm of ``x`` (``residual is None``) or of ``stream = x + residual``. Same contract as
    :func:`rms_norm_reference`; the sum is written into ``residual``'s own storage (no allocation), so the caller
    must use the returned stream and not the old ``residual``.

    Args:
        x: ``[T, hidden]`` fp32/fp16/bf16, unit column stride.
        weight: ``[hidden]``, x's dtype.
        residual: None, or ``[T, hidden]`` of x's dtype, unit column stride.
    Returns:
        ``(out [T, hidden] contiguous, stream [T, hidden])`` in x's dtype; ``stream`` is ``x`` without a residual.
    """
    _check(x, weight, residual)
    rows, hidden = x.shape
    block, num_warps = rms_norm_config(hidden)
    out = torch.empty((rows, hidden), dtype=x.dtype, device=x.device)
    if rows == 0:
        return out, (x if residual is None else residual)
    _fused_add_rms_norm_kernel[(rows,)](
        x, residual if residual is not None else x, weight, out, hidden, x.stride(0),
        residual.stride(0) if residual is not None else 0, float(eps),
        HAS_RESIDUAL=residual is not None, BLOCK=block, num_warps=num_warps,
    )  # fmt: skip
    return out, (x if residual is None else residual)


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """The torch RMSNorm (gpt-fast's: fp32 math, ``.to(dtype)`` before the weight): ``x [..., hidden]`` and
    ``weight [hidden]`` of one dtype -> ``[..., hidden]`` in that dtype. The CPU path of the model's norms."""
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(x.dtype)


def fused_add_rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float,
                                 residual: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(rms_norm(stream), stream)`` with ``stream = x + residual`` (rounded to the model dtype, as the unfused
    ``x = x + layer(x)``), or ``stream = x`` without a residual. Inputs are not modified. The oracle of
    :func:`fused_add_rms_norm` and the CPU path of the decoder layers: the same operations as an unfused layer, so
    the CPU forward's values do not change."""
    stream = x if residual is None else x + residual
    return rms_norm_reference(stream, weight, eps), stream
