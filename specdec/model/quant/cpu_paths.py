"""The fast CPU paths of ``QuantizedLinear`` and the torch reference of each one's own arithmetic.

Measured (docs/benchmarks.md, "Quantized linears"): torch's weight-only int8 op (``_weight_int8pack_mm``) and
int4 op (``_weight_int4pack_mm_for_cpu``) save little at one row and lose to the bf16 prepacked GEMM from ~5 rows,
because they do not stream the weight once for several rows. oneDNN's int8 GEMM (``onednn.qlinear_pointwise``,
VNNI) does, and beats bf16 prepacked at every row count measured - but it multiplies int8 by int8, so the
activations are quantised too. That makes the "w8a8" path a different arithmetic from the weight-only reference:

    w8a8:  x_scale[m] = max|x[m, :]| / 127 (1 for a zero row), xq = round(x / x_scale) in [-127, 127]
           y[m, n]    = fp32(sum_k xq[m, k] * q[n, k]) * w_scale[n] * x_scale[m]  (+ bias[n])

The integer sum is exact (int32), each row's scale depends on that row only, so a row's output is the same bit for
bit whether it is computed alone (a decode) or with others (a k+1 verification window): what speculative
decoding's equivalence needs. ``w8a8_reference`` computes the same arithmetic in torch (the integer sum in fp64,
exact) and the tests hold the oneDNN path to it exactly.

"int4pack": ``_weight_int4pack_mm_for_cpu`` in bf16 (weight-only; the op's tinygemm form ``(q - 8) * s + z`` with
``s`` and ``z = offset + 8 s`` rounded to bf16, activations rounded to bf16, fp32 accumulation). Row-independent
too (tested); its reference is ``int4pack_reference`` (the same rounded weights, compared with a tolerance: the op's
internal order of accumulation is its own).
"""

from __future__ import annotations

import functools

import torch

INT4PACK_GROUP_SIZES = (32, 64, 128, 256)  # what _weight_int4pack_mm_for_cpu accepts


@functools.cache
def w8a8_available() -> bool:
    """True where this torch has oneDNN's int8 linear (``onednn.qlinear_prepack`` / ``qlinear_pointwise``)."""
    try:
        w = torch.ones(16, 16, dtype=torch.int8)
        packed = torch.ops.onednn.qlinear_prepack(w, [1, 16])
        out = torch.ops.onednn.qlinear_pointwise(
            torch.full((1, 16), 129, dtype=torch.uint8), 1.0, 128, packed, torch.ones(16),
            torch.zeros(16, dtype=torch.int64), None, 1.0, 0, torch.float32, "none", [], "")
        return bool(torch.all(out == 16))
    except (AttributeError, RuntimeError):
        return False


@functools.cache
def int4pack_available() -> bool:
    """True where this torch has ``_weight_int4pack_mm_for_cpu``."""
    try:
        packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(torch.zeros(16, 64, dtype=torch.int32), 1)
        sz = torch.zeros(2, 16, 2, dtype=torch.bfloat16)
        torch.ops.aten._weight_int4pack_mm_for_cpu(torch.zeros(1, 64, dtype=torch.bfloat16), packed, 32, sz)
        return True
    except (AttributeError, RuntimeError):
        return False


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric int8 per row of ``x [M, K]``: ``xq`` fp32 ``[M, K]`` (integers in [-127, 127]; 0 in a non-finite
    row) and ``x_scale`` fp32 ``[M, 1]`` (max |x| / 127 per row, 1 for an all-zero row, NaN for a row holding a NaN
    or an infinity)."""
    x32 = x.float()
    amax = x32.abs().amax(-1, keepdim=True)  # (M, 1)
    x_scale = torch.where(amax > 0, amax / 127, torch.ones_like(amax))
    # a row holding a NaN or an infinity gets a NaN scale, so its outputs are NaN and the engine's non-finite check
    # sees them (``amax > 0`` is False for NaN: the row would otherwise be scaled by 1 into finite garbage)
    x_scale = torch.where(torch.isfinite(amax), x_scale, torch.full_like(amax, float("nan")))
    return torch.round(x32 / x_scale).nan_to_num_(0.0).clamp_(-127, 127), x_scale


def w8a8_prepare(q: torch.Tensor, scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """oneDNN state of an int8 per-channel weight (``q`` int8 ``[N, K]``, ``scale`` fp32 ``[N, 1]``):
    (packed weight, scales fp32 ``[N]``, zero points int64 ``[N]``)."""
    n, k = q.shape
    packed = torch.ops.onednn.qlinear_prepack(q.contiguous(), [1, k])
    return packed, scale.reshape(n).float().contiguous(), torch.zeros(n, dtype=torch.int64)


def w8a8_linear(x: torch.Tensor, state: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
                bias: torch.Tensor | None) -> torch.Tensor:
    """``x [M, K]`` (any float dtype) through oneDNN's int8 GEMM with per-row activation scales; fp32 ``[M, N]``."""
    packed, w_scale, w_zero = state
    xq, x_scale = quantize_rows(x)
    xu = (xq + 128).to(torch.uint8)  # (M, K) symmetric int8 shifted to uint8, zero point 128
    acc = torch.ops.onednn.qlinear_pointwise(xu, 1.0, 128, packed, w_scale, w_zero, None, 1.0, 0, torch.float32,
                                             "none", [], "")  # (M, N) = fp32(int sum) * w_scale
    out = acc * x_scale
    return out + bias.float() if bias is not None else out


def w8a8_reference(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """The w8a8 arithmetic in torch: ``x [M, K]``, ``q`` int8 ``[N, K]``, ``scale`` fp32 ``[N, 1]``; fp32 ``[M, N]``
    (the integer sums in fp64, exact, rounded once to fp32)."""
    xq, x_scale = quantize_rows(x)
    acc = (xq.double() @ q.double().T).float()  # (M, N) exact integer sums, rounded once to fp32
    out = acc * scale.reshape(1, -1).float() * x_scale
    return out + bias.float() if bias is not None else out


def int4pack_prepare(q: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``_weight_int4pack_mm_for_cpu`` state of an int4 weight (``q`` unpacked uint8 ``[N, K]``, ``scale`` /
    ``offset`` fp32 ``[N, G]``): (packed uint8, scales-and-zeros bf16 ``[G, N, 2]`` with zero = offset + 8 scale)."""
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.to(torch.int32).contiguous(), 1)
    sz = torch.stack([scale.T, (offset + 8 * scale).T], dim=-1).to(torch.bfloat16).contiguous()  # (G, N, 2)
    return packed, sz


def int4pack_linear(x: torch.Tensor, state: tuple[torch.Tensor, torch.Tensor], group_size: int,
                    bias: torch.Tensor | None) -> torch.Tensor:
    """``x [M, K]`` through ``_weight_int4pack_mm_for_cpu`` in bf16; fp32 ``[M, N]``."""
    packed, sz = state
    out = torch.ops.aten._weight_int4pack_mm_for_cpu(x.to(torch.bfloat16).contiguous(), packed, group_size, sz)
    out = out.float()
    return out + bias.float() if bias is not None else out


def int4pack_reference(x: torch.Tensor, q: torch.Tensor, sz: torch.Tensor, group_size: int,
                       bias: torch.Tensor | None) -> torch.Tensor:
    """The int4pack arithmetic in torch: bf16 ``x``, weights ``(q - 8) * s + z`` from the bf16 ``sz [G, N, 2]``
    (``q`` unpacked uint8 ``[N, K]``), fp32 matmul; fp32 ``[M, N]``."""
    s = sz[..., 0].float().T.repeat_interleave(group_size, 1)  # (N, K)
    z = sz[..., 1].float().T.repeat_interleave(group_size, 1)  # (N, K)
    w = (q.float() - 8) * s + z
    out = x.to(torch.bfloat16).float() @ w.T
    return out + bias.float() if bias is not None else out
