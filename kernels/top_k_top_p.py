"""Top-k, then top-p, then min-p filtering of probability rows, in the order and tie rule of the contract.

Order (docs/architecture.md, standardization): top-k (keep every token whose probability is >= the k-th
largest) -> renormalise -> top-p (keep a token iff the mass of tokens with strictly larger probability is
< p) -> renormalise -> min-p (keep tokens with probability >= min_p * max probability) -> renormalise.
Ties are always kept together, so the kept set does not depend on any ordering of equal values.
k = 0 (or k >= V), p >= 1 and min_p = 0 are no-ops; the max-probability run is always kept.

How the kept set is made exact and identical in the kernel and the reference:
- Renormalising divides a row by a scalar, which changes neither the order of the values nor mass ratios, so
  every decision is taken on the *input* values with the renormalisations folded into the thresholds: top-p
  compares mass(p > v) with ``top_p * (mass kept by top-k)``, min-p compares p with ``min_p * max(p)``. The
  output is then one renormalisation of the kept input values. (Dividing first and comparing the rounded
  quotients could merge neighbouring values into new ties and move the boundary by an ulp.)
- Masses are sums of fixed-point integers ``floor(p * 2**42)`` in int64: integer addition is exact, so the
  sum does not depend on the summation order (sorted cumsum in the reference, chunked tree sums in the kernel).
  The comparison ``mass.double() < top_p.double() * kept_mass.double()`` is the same few IEEE operations in
  both. Quantisation ignores < 2**-42 per token (< 2.4e-7 of mass at V = 2**20), far below fp32 resolution.
- Thresholds are found by bisection over the fp32 bit patterns (monotone in value for p >= 0): each step
  counts (top-k) or sums (top-p) over the row, ~31 steps, no sort (a sort spills on GPU and takes minutes
  in the interpreter). Each search lands exactly on a value present in the row.
"""

from typing import NamedTuple

import torch
from specdec.kernels._triton import tl, triton

# NOTE: 2**42 * V <= 2**62 for V <= MAX_VOCAB and p <= 1, so int64 fixed-point masses cannot overflow.
MASS_SCALE = 2.0**42
MAX_VOCAB = 1 << 20
_MAX_BLOCK = 2048  # fp32 elements per chunk; the top-p pass also holds int64 masses (8 per thread at 8 warps)


class RowConfig(NamedTuple):
    """Launch settings of a row-wise kernel."""

    block: int  # elements per chunk of the row loop (power of two)
    num_warps: int


def top_k_top_p_config(vocab: int) -> RowConfig:
    """Fixed block size / warp count for rows of ``vocab`` elements; raises ``ValueError`` on rows too long."""
    if not 1 <= vocab <= MAX_VOCAB:
        raise ValueError(f"top_k_top_p_min_p supports 1 <= vocab <= {MAX_VOCAB}, got {vocab}")
    block = min(triton.next_power_of_2(vocab), _MAX_BLOCK)
    return RowConfig(block=block, num_warps=4 if block < 2048 else 8)


@triton.jit
def _top_k_top_p_min_p_kernel(
    probs_ptr,  # fp32 [R, V], unit column stride, values >= 0
    top_k_ptr,  # int64 [R]
    top_p_ptr,  # fp32 [R]
    min_p_ptr,  # fp32 [R]
    out_ptr,  # fp32 [R, V], unit column stride
    vocab,
    probs_row_stride,
    out_row_stride,
    MASS_SCALE: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    probs_row = probs_ptr + row * probs_row_stride
    out_row = out_ptr + row * out_row_stride
    cols = tl.arange(0, BLOCK)
    k = tl.load(top_k_ptr + row)
    top_p = tl.load(top_p_ptr + row)
    min_p = tl.load(min_p_ptr + row)

    # Pass 0: row max and min (they bracket both searches).
    acc_max = tl.full([BLOCK], float("-inf"), tl.float32)
    acc_min = tl.full([BLOCK], float("inf"), tl.float32)
    for start in range(0, vocab, BLOCK):
        offs = start + cols
        mask = offs < vocab
        x = tl.load(probs_row + offs, mask=mask, other=0.0)
        acc_max = tl.maximum(acc_max, tl.where(mask, x, float("-inf")))
        acc_min = tl.minimum(acc_min, tl.where(mask, x, float("inf")))
    row_max = tl.max(acc_max, axis=0)
    max_bits = row_max.to(tl.int32, bitcast=True)
    # NOTE: clamp in the integer domain: -0.0 has the bit pattern of a negative int32 and compares == 0.0.
    min_bits = tl.maximum(tl.min(acc_min, axis=0).to(tl.int32, bitcast=True), 0)

    # Top-k: the largest t with count(p >= t) >= k is the k-th largest value. Invariant: count(p >= lo) >= k.
    lo = min_bits
    hi = tl.where((k > 0) & (k < vocab), max_bits, min_bits)  # inactive: lo == hi, nothing to search
    while lo < hi:
        mid = lo + ((hi - lo + 1) >> 1)
        t = mid.to(tl.float32, bitcast=True)
        count = tl.zeros([BLOCK], tl.int32)
        for start in range(0, vocab, BLOCK):
            offs = start + cols
            x = tl.load(probs_row + offs, mask=offs < vocab, other=-1.0)  # -1 never counts (t >= 0)
            count += (x >= t).to(tl.int32)
        enough = tl.sum(count, axis=0) >= k
        lo = tl.where(enough, mid, lo)
        hi = tl.where(enough, hi, mid - 1)
    k_bits = lo
    t_k = k_bits.to(tl.float32, bitcast=True)

    # Top-p: the smallest row value v >= t_k with mass(p > v) < top_p * mass(p >= t_k). Invariant: the answer
    # is in [lo, hi]; hi starts at the row max, which is kept even when nothing satisfies the test (p <= 0).
    p_active = top_p < 1.0
    kept_mass = tl.zeros([BLOCK], tl.int64)
    for start in range(0, tl.where(p_active, vocab, 0), BLOCK):  # NOTE: zero trips when top-p is off
        offs = start + cols
        x = tl.load(probs_row + offs, mask=offs < vocab, other=0.0)
        kept_mass += tl.where(x >= t_k, (x * MASS_SCALE).to(tl.int64), 0)
    mass_limit = top_p.to(tl.float64) * tl.sum(kept_mass, axis=0).to(tl.float64)
    lo = k_bits
    hi = tl.where(p_active, max_bits, k_bits)
    while lo < hi:
        mid = lo + ((hi - lo) >> 1)
        t = mid.to(tl.float32, bitcast=True)
        mass = tl.zeros([BLOCK], tl.int64)
        for start in range(0, vocab, BLOCK):
            offs = start + cols
            x = tl.load(probs_row + offs, mask=offs < vocab, other=0.0)
            mass += tl.where(x > t, (x * MASS_SCALE).to(tl.int64), 0)
        below = tl.sum(mass, axis=0).to(tl.float64) < mass_limit
        hi = tl.where(below, mid, hi)
        lo = tl.where(below, lo, mid + 1)
    t_p = hi.to(tl.float32, bitcast=True)

    # Min-p relative to the row max (which top-k and top-p always keep), then one renormalisation.
    min_p = tl.minimum(tl.where(min_p > 0, min_p, 0.0), 1.0)  # clamp to [0, 1]; NaN -> 0 (off)
    threshold = tl.maximum(t_p, min_p * row_max)
    acc_sum = tl.zeros([BLOCK], tl.float32)
    for start in range(0, vocab, BLOCK):
        offs = start + cols
        x = tl.load(probs_row + offs, mask=offs < vocab, other=0.0)
        acc_sum += tl.where(x >= threshold, x, 0.0)
    inv_sum = 1.0 / tl.sum(acc_sum, axis=0)
    for start in range(0, vocab, BLOCK):
        offs = start + cols
        mask = offs < vocab
        x = tl.load(probs_row + offs, mask=mask, other=0.0)
        tl.store(out_row + offs, tl.where(x >= threshold, x * inv_sum, 0.0), mask=mask)


def top_k_top_p_min_p(
    probs: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, min_p: torch.Tensor
) -> torch.Tensor:
    """Triton top-k / top-p / min-p filter; same contract and kept sets as :func:`top_k_top_p_min_p_reference`.

    Args:
        probs: fp32 ``[R, V]`` non-negative rows (summing to 1), unit column stride, ``V <= MAX_VOCAB``.
        top_k: int32/int64 ``[R]``, ``<= 0`` or ``>= V`` = off.
        top_p: fp32 ``[R]``, ``>= 1`` = off.
        min_p: fp32 ``[R]``, ``<= 0`` = off, clamped to at most 1.
    Returns:
        fp32 ``[R, V]`` contiguous, filtered and renormalised (filtered tokens are exactly 0).
    """
    if probs.ndim != 2 or probs.dtype != torch.float32:
        raise ValueError(f"probs must be fp32 [R, V], got {probs.dtype} {tuple(probs.shape)}")
    rows, vocab = probs.shape
    if vocab > 1 and probs.stride(1) != 1:
        raise ValueError("probs must have unit column stride (call .contiguous())")
    for name, value, dtypes in (
        ("top_k", top_k, (torch.int32, torch.int64)),
        ("top_p", top_p, (torch.float32,)),
        ("min_p", min_p, (torch.float32,)),
    ):
        if value.shape != (rows,) or value.dtype not in dtypes:
            raise ValueError(f"{name} must be {dtypes} [{rows}], got {value.dtype} {tuple(value.shape)}")
        if value.device != probs.device:
            raise ValueError(f"{name} is on {value.device}, probs on {probs.device}")
    block, num_warps = top_k_top_p_config(vocab)

    out = torch.empty((rows, vocab), dtype=torch.float32, device=probs.device)
    if rows == 0:
        return out
    _top_k_top_p_min_p_kernel[(rows,)](
        probs,
        top_k.to(torch.int64).contiguous(),
        top_p.contiguous(),
        min_p.contiguous(),
        out,
        vocab,
        probs.stride(0),
        out.stride(0),
        MASS_SCALE=MASS_SCALE,
        BLOCK=block,
        num_warps=num_warps,
    )
    return out


def top_k_top_p_min_p_reference(
    probs: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, min_p: torch.Tensor
) -> torch.Tensor:
    """Torch reference (and CPU path) of top-k / top-p / min-p filtering.

    Args:
        probs: fp32 ``[R, V]`` non-negative rows summing to 1.
        top_k: int32/int64 ``[R]``, ``<= 0`` or ``>= V`` = off.
        top_p: fp32 ``[R]`` in (0, 1], ``>= 1`` (or NaN) = off; ``<= 0`` keeps only the max run.
        min_p: fp32 ``[R]`` in [0, 1], ``<= 0`` (or NaN) = off; above 1 acts as 1. The threshold is the fp32
            product ``min_p * max(p)``.
    Returns:
        fp32 ``[R, V]`` filtered and renormalised rows (filtered tokens are exactly 0).
    """
    p = probs.float()
    vocab = p.shape[-1]
    sorted_desc = p.sort(dim=-1, descending=True).values  # (R, V)
    row_max = sorted_desc[:, :1]  # (R, 1)

    # top-k: the k-th largest value is the threshold; everything >= it survives (ties kept).
    k = top_k.long()
    k = torch.where((k <= 0) | (k > vocab), torch.full_like(k, vocab), k)
    t_k = sorted_desc.gather(-1, (k - 1)[:, None])  # (R, 1)

    # top-p on the top-k survivors (renormalisation folded into the limit, see the module docstring). Sorted
    # descending, the mass strictly above a token is the exclusive prefix sum at the first member of its tie run.
    mass = torch.where(sorted_desc >= t_k, (sorted_desc * MASS_SCALE).long(), 0)  # (R, V) int64 fixed point
    exclusive = mass.cumsum(dim=-1) - mass  # (R, V)
    first_of_run = torch.ones_like(sorted_desc, dtype=torch.bool)
    first_of_run[:, 1:] = sorted_desc[:, 1:] != sorted_desc[:, :-1]
    mass_above = torch.where(first_of_run, exclusive, -1).cummax(dim=-1).values  # (R, V)
    top_p32 = top_p.float()[:, None]  # (R, 1)
    mass_limit = top_p32.double() * mass.sum(dim=-1, keepdim=True).double()  # (R, 1)
    num_kept = (mass_above.double() < mass_limit).sum(dim=-1, keepdim=True).clamp(min=1)  # (R, 1)
    t_p = torch.where(top_p32 < 1, sorted_desc.gather(-1, num_kept - 1), t_k)  # (R, 1) smallest kept value

    # min-p relative to the row max (always kept), then one renormalisation of the kept input values.
    min_p32 = min_p.float()[:, None]  # (R, 1)
    min_p32 = torch.where(min_p32 > 0, min_p32, 0.0).clamp(max=1)  # clamp to [0, 1]; NaN -> 0 (off)
    threshold = torch.maximum(t_p, min_p32 * row_max)  # (R, 1)
    out = torch.where(p >= threshold, p, torch.zeros_like(p))
    return out / out.sum(dim=-1, keepdim=True)
