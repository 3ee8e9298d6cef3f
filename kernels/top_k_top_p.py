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
- Thresholds are found by a radix select over the fp32 bit patterns (keys; for p >= 0 they order like the
  values), 4 bits per pass from the top: a pass builds a 16-bin histogram of the next digit over the elements
  whose key agrees with the digits fixed so far - counts for top-k (the k-th largest key: the largest digit whose
  count of keys >= it still reaches k), fixed-point masses for top-p (the smallest key t with mass(p > t) below
  the limit: the lowest digit whose mass strictly above its bin is below the limit). 8 passes per active filter
  instead of the ~31 of a bisection, the same exact integer comparisons, no sort (a sort spills on GPU and takes
  minutes in the interpreter). Both searches land exactly on a value present in the row.
- Passes over the row (a pass reads the whole row once): 1 (max/min) + 8 (top-k, if on) + 1 (kept mass, if
  top-p is on) + 8 (top-p, if on) + 2 (sum of the kept values, write) = 20 with both filters on. The bisection
  this replaces took ``ceil(log2(n))`` passes per filter at most, n the searched bit-pattern range (top-k:
  max_bits - min_bits + 1, top-p: max_bits - k_bits + 1): up to 30 for values in [0, 1], ~29 on softmax rows.
  The price is arithmetic: a radix pass does 16 compare-and-adds per element (one per bin) where a bisection
  step did one, so fewer reads of the row, more ALU work per read (GPU time unmeasured).
"""

from typing import NamedTuple

import torch

from specdec.kernels._triton import tl, triton

# NOTE: 2**42 * V <= 2**62 for V <= MAX_VOCAB and p <= 1, so int64 fixed-point masses cannot overflow.
MASS_SCALE = 2.0**42
MAX_VOCAB = 1 << 20
_MAX_BLOCK = 2048  # fp32 elements per chunk; the top-p pass also holds int64 masses (8 per thread at 8 warps)
# Radix select: 4-bit digits of the 32-bit key, most significant first (bit 31 is always 0 after the clamp).
RADIX_SELECT_PASSES = 32 // 4  # passes over the row per active filter (the benchmark reports it)
RADIX_BITS = tl.constexpr(4)
RADIX_BINS = tl.constexpr(16)
RADIX_PASSES = tl.constexpr(RADIX_SELECT_PASSES)
HIST_BLOCK = tl.constexpr(128)  # (128, 16) one-hot tiles: 64 registers, no spills (256: spills on sm_80/sm_90)


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
def _radix_histogram(
    probs_row, vocab, prefix, shift, active, MASS: tl.constexpr, MASS_SCALE: tl.constexpr, BLOCK: tl.constexpr
):  # fmt: skip
    """One pass over the row: per digit ``(key >> shift) & 15``, the count (``MASS`` False) or the fixed-point
    mass of the elements whose key agrees with ``prefix`` above bit ``shift + 4``. Zero trips when not active.

    Chunks of BLOCK elements, each as BLOCK / HIST_BLOCK unrolled (HIST_BLOCK, RADIX_BINS) one-hot tiles: the
    unrolled loads are independent (several in flight per thread), the tiles stay small (no spills).
    """
    cols = tl.arange(0, HIST_BLOCK)
    bins = tl.arange(0, RADIX_BINS)
    if MASS:
        acc = tl.zeros([HIST_BLOCK, RADIX_BINS], tl.int64)
    else:
        acc = tl.zeros([HIST_BLOCK, RADIX_BINS], tl.int32)
    for start in range(0, tl.where(active, vocab, 0), BLOCK):
        for sub in tl.static_range(0, BLOCK, HIST_BLOCK):  # NOTE: BLOCK < HIST_BLOCK only when BLOCK >= vocab
            offs = start + sub + cols
            valid = offs < vocab
            x = tl.load(probs_row + offs, mask=valid, other=0.0)
            # NOTE: keys of non-negative floats order like the floats; -0.0 (a negative int32) becomes key 0.
            key = tl.maximum(x.to(tl.int32, bitcast=True), 0)
            match = valid & (((key ^ prefix) >> shift) < RADIX_BINS)  # same bits as prefix above this digit
            hit = ((key >> shift) & (RADIX_BINS - 1))[:, None] == bins[None, :]  # one-hot digit
            hit = hit & match[:, None]
            if MASS:
                acc += tl.where(hit, (x * MASS_SCALE).to(tl.int64)[:, None], 0)
            else:
                acc += hit.to(tl.int32)
    return tl.sum(acc, axis=0)


@triton.jit
def _suffix_sum(hist):
    """``out[d] = sum(hist[d:])`` of a RADIX_BINS vector (a 16 x 16 masked sum; no scan primitive needed)."""
    bins = tl.arange(0, RADIX_BINS)
    return tl.sum(tl.where(bins[None, :] >= bins[:, None], hist[None, :], 0), axis=1)


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
    bins = tl.arange(0, RADIX_BINS)
    k = tl.load(top_k_ptr + row)

    # Pass 0: row max and min.
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

    # Top-k: the largest key t with count(key >= t) >= k (the k-th largest value), fixed 4 bits per pass from the
    # top. Invariant: count(key >= prefix) >= k; `above` = count of keys above every key with this prefix.
    k_on = (k > 0) & (k < vocab)
    prefix = min_bits * 0
    above = min_bits * 0
    for level in range(RADIX_PASSES):
        shift = 28 - RADIX_BITS * level
        hist = _radix_histogram(probs_row, vocab, prefix, shift, k_on, False, MASS_SCALE, BLOCK)
        at_least = above + _suffix_sum(hist)  # [d]: count(key >= prefix | d << shift)
        digit = tl.sum((at_least >= k).to(tl.int32), axis=0) - 1  # the largest such d (d = 0 always qualifies)
        above += tl.sum(tl.where(bins > digit, hist, 0), axis=0)
        prefix = prefix | (digit << shift)
    k_bits = tl.where(k_on, prefix, min_bits)  # inactive: the row min keeps everything
    t_k = k_bits.to(tl.float32, bitcast=True)

    # Top-p: the smallest key t with mass(p > t) < top_p * mass(p >= t_k). mass(p > t) >= mass(p >= t_k) >= limit
    # for any t < t_k, so the search needs no lower bound and lands on a row value >= t_k. Invariant:
    # mass_above (mass above every key with this prefix) < limit. limit <= 0: nothing qualifies -> the row max.
    top_p = tl.load(top_p_ptr + row)
    p_active = top_p < 1.0
    kept_mass = tl.zeros([BLOCK], tl.int64)
    for start in range(0, tl.where(p_active, vocab, 0), BLOCK):  # NOTE: zero trips when top-p is off
        offs = start + cols
        x = tl.load(probs_row + offs, mask=offs < vocab, other=0.0)
        kept_mass += tl.where(x >= t_k, (x * MASS_SCALE).to(tl.int64), 0)
    mass_limit = top_p.to(tl.float64) * tl.sum(kept_mass, axis=0).to(tl.float64)
    p_search = p_active & (mass_limit > 0)
    prefix = min_bits * 0
    mass_above = tl.sum(kept_mass, axis=0) * 0
    for level in range(RADIX_PASSES):
        shift = 28 - RADIX_BITS * level
        hist = _radix_histogram(probs_row, vocab, prefix, shift, p_search, True, MASS_SCALE, BLOCK)
        beyond = mass_above + _suffix_sum(hist) - hist  # [d]: mass(key > (prefix | d << shift | lower bits all 1))
        digit = tl.sum(tl.where(beyond.to(tl.float64) < mass_limit, 0, 1), axis=0)  # the smallest d below the limit
        mass_above += tl.sum(tl.where(bins > digit, hist, 0), axis=0)
        prefix = prefix | (digit << shift)
    t_p = tl.where(p_search, prefix, tl.where(p_active, max_bits, k_bits)).to(tl.float32, bitcast=True)

    # Min-p relative to the row max (which top-k and top-p always keep), then one renormalisation.
    min_p = tl.load(min_p_ptr + row)  # NOTE: loaded where used: live across the passes, it got a cold spill
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
