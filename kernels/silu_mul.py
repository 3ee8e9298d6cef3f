"""SwiGLU's gate: ``silu(gate) * up`` read from the fused gate/up projection's output, in one kernel.

The unfused ``F.silu(gate) * up`` over the two halves of ``gate_up [T, 2I]`` is two kernels and one ``[T, I]``
intermediate in memory. Here each program reads a ``BLOCK``-wide slice of one row's gate and up halves and writes
the product. Rounding follows the torch reference (``silu_mul_reference``): silu is rounded to the model dtype
before the multiply, the product rounded again; the only difference left is ``exp``'s last bits.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from specdec.kernels._triton import tl, triton

_BLOCK = 1024  # elements of a row per program (8 per thread at 4 warps)


@triton.jit
def _silu_mul_kernel(
    gate_up_ptr,  # [T, 2I] model dtype, unit column stride: gate in columns [0, I), up in [I, 2I)
    out_ptr,  # [T, I] model dtype, contiguous
    inter,  # I
    gate_up_row_stride,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < inter
    dtype = out_ptr.dtype.element_ty
    base = gate_up_ptr + row * gate_up_row_stride
    gate = tl.load(base + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(base + inter + cols, mask=mask, other=0.0).to(tl.float32)
    silu = (gate / (1.0 + tl.exp(-gate))).to(dtype).to(tl.float32)
    tl.store(out_ptr + row * inter + cols, (silu * up).to(dtype), mask=mask)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """Triton ``silu(gate) * up``; same contract as :func:`silu_mul_reference`.

    Args:
        gate_up: ``[T, 2I]`` fp32/fp16/bf16 with unit column stride, gate first.
    Returns:
        ``[T, I]`` contiguous, gate_up's dtype.
    """
    if gate_up.ndim != 2 or gate_up.shape[1] % 2:
        raise ValueError(f"gate_up must be [T, 2 * intermediate], got shape {tuple(gate_up.shape)}")
    if gate_up.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        raise ValueError(f"gate_up must be fp32/fp16/bf16, got {gate_up.dtype}")
    if gate_up.shape[1] > 1 and gate_up.stride(1) != 1:
        raise ValueError("gate_up must have unit column stride (call .contiguous())")
    rows, inter = gate_up.shape[0], gate_up.shape[1] // 2
    out = torch.empty((rows, inter), dtype=gate_up.dtype, device=gate_up.device)
    if rows == 0 or inter == 0:
        return out
    block = min(_BLOCK, triton.next_power_of_2(inter))
    _silu_mul_kernel[(rows, triton.cdiv(inter, block))](gate_up, out, inter, gate_up.stride(0), BLOCK=block,
                                                        num_warps=4)
    return out


def silu_mul_reference(gate_up: torch.Tensor) -> torch.Tensor:
    """``silu(gate_up[:, :I]) * gate_up[:, I:]`` in gate_up's dtype: ``[T, 2I] -> [T, I]``. The CPU path of the
    model's MLPs and the oracle of :func:`silu_mul`."""
    gate, up = gate_up.split(gate_up.shape[-1] // 2, dim=-1)  # each (T, I)
    return F.silu(gate) * up
