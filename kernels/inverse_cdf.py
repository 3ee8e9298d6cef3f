"""Categorical sampling by inverse CDF: one uniform per row, the first token whose cumulative weight exceeds it.

The contract (docs/architecture.md, "Randomness"): a row of non-negative weights ``w [V]`` (a standardized p, a
draft's q, a verification residual; it need not sum to 1) and one uniform ``U`` in (0, 1) from
:func:`specdec.kernels.philox.draw_uniforms` give the token ``i`` with ``C(i - 1) <= U * total < C(i)``, ``C`` the
cumulative sum of ``w`` in token-id order and ``total = C(V - 1)``: token i is drawn with probability
``w_i / total``, and a token of weight 0 never (its interval is empty). One Philox evaluation per row instead of
a V-wide noise row (the exponential race ``argmax(w / E)`` it replaces cost 7-20 ns per element on CPU).

How the cumulative sum is computed, so that every implementation (the torch code here, which is the CPU path and
runs on CUDA tensors too, and the Triton kernels of spec_sample / block_verify / tree_sample) picks the same token:

- Chunks of ``CDF_CHUNK`` = 256 ids (the last one zero-padded). A chunk's weight ``S_c`` is an fp32 sum in one
  canonical order, not "whatever order a reduction uses": halve the chunk, add element i to element i + h, and
  repeat (h = 128, 64, ..., 1). Each step is an elementwise IEEE addition, so torch (in-place strided adds, on
  CPU or CUDA) and Triton (the chunk held as a (2, 2, ..., 2) tensor, reduced over axis 0 eight times: one
  addition per pair) produce the same bits. A reduction in a free order would differ in the last bit between a
  kernel and its reference and move the chunk boundaries by ~1e-7: a token mismatch in ~1e-6 of the draws at
  V = 128K. (One read of the row on CPU, no [R, V] temporary: 2-8x a plain ``sum``, far below the noise it
  replaces.)
- ``cum_c = cum_(c-1) + S_c`` in float64, sequentially (torch's CPU cumsum; the kernels add one chunk per loop
  iteration), ``total = cum_(C-1)``, ``t = U * total`` capped at the largest float64 below the total (``U *
  total`` can round up to it). The chunk is the first c with ``cum_c > t``; for a total > 0 one always passes,
  and it has ``S_c > 0``.
- Inside the chunk, the remaining fraction of ``t`` is rescaled to the chunk's float64 cumulative sum ``L`` of
  its fp32 weights (exact to ~1e-16): the token is the chunk's first id with ``L_i > (t - cum_(c-1)) / S_c *
  L_last``, tested without a division as ``L_i * S_c > (t - cum_(c-1)) * L_last``. So every token of a chunk is
  drawn with probability ``w_i / total`` times ``S_c / L_last``: a relative error below ~5e-7 (the fp32 rounding
  of ``S_c``, 8 additions deep), spread evenly over the chunk instead of piled on one token.
- Robustness: when rounding puts the rescaled threshold at or past ``L_last``, the token is the chunk's last id
  with a nonzero weight - never a zero-weight token. A row whose total is 0, NaN or inf passes no chunk and
  gives token 0 (an all-zero row: as the exponential race gave; NaN/inf: garbage, never an out-of-range index -
  callers flag such rows). Callers that can meet an all-zero row (a verification residual with p <= q) test
  for it and sample from p instead.

Where implementations may still differ: float64 rounding only (``torch.cumsum`` on CUDA scans in parallel,
``tl.cumsum`` is a tree), so a token mismatch needs a threshold within ~1e-16 of a boundary. The uniform has 46
random bits (2**-46 ~ 1.4e-14), far finer than fp32 probabilities.
"""

from __future__ import annotations

import torch

from specdec.kernels._triton import tl, triton
from specdec.kernels.philox import draw_uniforms

CDF_CHUNK = 256  # ids per chunk of the two-level search (a power of two; part of the contract, see above)
_CDF_CHUNK: tl.constexpr = tl.constexpr(CDF_CHUNK)
BELOW_ONE = 1.0 - 2.0**-53  # total * BELOW_ONE is the largest float64 below a (normal, > 0) total
_BELOW_ONE: tl.constexpr = tl.constexpr(BELOW_ONE)
_ROW_BLOCK_ELEMENTS = 1 << 20  # chunk sums a block of rows at a time: its fp32 scratch stays ~4 MB


def chunk_sums(weights: torch.Tensor) -> torch.Tensor:
    """The chunk weights ``S``: fp32 ``[R, ceil(V / CDF_CHUNK)]`` from fp32 ``weights [R, V]`` (contiguous rows),
    each the canonical halving sum of its 256 ids (module docstring), bit-identical to the kernels' ``_chunk_sum``.

    One read of the rows and no ``[R, V]`` temporary (a block of rows at a time, added in place)."""
    rows, vocab = weights.shape
    full, rest = divmod(vocab, CDF_CHUNK)
    out = torch.empty(rows, full + (rest > 0), dtype=torch.float32, device=weights.device)
    half = CDF_CHUNK // 2
    if full:
        body = weights[:, : full * CDF_CHUNK].view(rows, full, CDF_CHUNK)
        step = max(1, _ROW_BLOCK_ELEMENTS // (full * half))
        for r0 in range(0, rows, step):
            r1 = min(rows, r0 + step)
            out[r0:r1, :full] = _halve(body[r0:r1, :, :half] + body[r0:r1, :, half:])
    if rest:
        tail = weights.new_zeros(rows, 1, CDF_CHUNK)
        tail[:, 0, :rest] = weights[:, full * CDF_CHUNK :]
        out[:, full] = _halve(tail[..., :half] + tail[..., half:])[:, 0]
    return out


def _halve(x: torch.Tensor) -> torch.Tensor:
    """The rest of the canonical sum of ``x [..., h]`` (the first halving done): x[i] += x[i + h / 2] in place,
    h halving down to 1; returns ``[...]``."""
    h = x.shape[-1] // 2
    while h >= 1:
        x[..., :h].add_(x[..., h : 2 * h])
        h //= 2
    return x[..., 0]


def inverse_cdf(weights: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """The token of each row drawn by inverse CDF (module docstring): int64 ``[R]`` on ``weights``' device.

    Args:
        weights: ``[R, V]`` (V >= 1), non-negative (fp32; other dtypes are converted to fp32 first).
        uniforms: float64 ``[R]`` in (0, 1), one per row (:func:`specdec.kernels.philox.draw_uniforms`).
    """
    if weights.dim() != 2 or weights.shape[-1] < 1 or uniforms.shape != (weights.shape[0],):
        raise ValueError(f"inverse_cdf needs weights [R, V] with V >= 1 and uniforms [R]; got weights "
                         f"{tuple(weights.shape)}, uniforms {tuple(uniforms.shape)}")
    weights = weights.to(torch.float32).contiguous()
    rows, vocab = weights.shape
    device = weights.device
    if rows == 0:
        return torch.zeros(0, dtype=torch.int64, device=device)
    sums = chunk_sums(weights)  # (R, C) fp32
    num_chunks = sums.shape[1]
    cum = sums.double().cumsum(dim=-1)  # (R, C) sequential on CPU, as the kernels add
    total = cum[:, -1]
    # U * total can round up to the total: cap it at the largest float64 below (NaN stays NaN)
    t = torch.minimum(uniforms.to(device=device, dtype=torch.float64) * total, total * BELOW_ONE)  # (R,)
    chunk = torch.searchsorted(cum, t[:, None], right=True)  # (R, 1) first c with cum_c > t; C: none
    cum = torch.nn.functional.pad(cum, (1, 0))  # (R, C + 1): cum_(c-1) at column c
    found = chunk.squeeze(1) < num_chunks  # none passed: a total of 0, NaN or inf - token 0 below
    chunk = chunk.clamp_(max=num_chunks - 1)
    base = cum.gather(1, chunk).squeeze(1)  # cum_(c-1)
    mass = sums.gather(1, chunk).squeeze(1).double()  # S_c
    ids = chunk * CDF_CHUNK + torch.arange(CDF_CHUNK, device=device)  # (R, CHUNK)
    if vocab % CDF_CHUNK:  # the last chunk is partial: ids past the vocabulary weigh 0
        local = torch.where(ids < vocab, weights.gather(1, ids.clamp(max=vocab - 1)), 0.0)
    else:
        local = weights.gather(1, ids)  # (R, CHUNK) the chunk's weights
    running = local.double().cumsum(dim=-1)  # (R, CHUNK) L
    # L_i > t' = (t - base) / S_c * L_last, without a division: L_i * S_c > (t - base) * L_last. Monotone in i, so
    # the lanes that fail it come first and count to the first that passes (CHUNK: none, by rounding - then the
    # last lane with weight, which is also never before a passing lane).
    lane = (running * mass[:, None] <= ((t - base) * running[:, -1])[:, None]).sum(dim=-1)
    lane = torch.minimum(lane, _last_positive(local))
    return torch.where(found, chunk.squeeze(1) * CDF_CHUNK + lane, 0)


def sample_inverse_cdf(weights: torch.Tensor, seeds: torch.Tensor, positions: torch.Tensor,
                       stream: int) -> torch.Tensor:
    """Exact categorical sampling of each row of ``weights [R, V]`` (non-negative, unnormalised) with its one
    uniform from Philox(seed, position, stream): int64 ``[R]`` on ``weights``' device (``seeds``, ``positions``:
    int64 ``[R]``)."""
    if seeds.shape != (weights.shape[0],) or positions.shape != seeds.shape:
        raise ValueError(f"sample_inverse_cdf needs seeds, positions [R] for weights [R, V]; got weights "
                         f"{tuple(weights.shape)}, seeds {tuple(seeds.shape)}, positions {tuple(positions.shape)}")
    return inverse_cdf(weights, draw_uniforms(seeds.to(weights.device), positions.to(weights.device), stream))


def _last_positive(x: torch.Tensor) -> torch.Tensor:
    """int64 ``[R]``: the last column of ``x [R, N]`` holding a value > 0, or 0 where there is none."""
    cols = torch.arange(x.shape[-1], device=x.device)
    return torch.where(x > 0, cols, 0).amax(dim=-1)


# ------------------------------------------------------------------------------------------------------ Triton


@triton.jit
def _chunk_ids():
    """The ids 0..255 of a chunk as an 8-D (2, 2, ..., 2) int32 tensor: id = sum_k b_k 2**(7 - k) (axis 0 holds
    the 128s bit, axis 7 the 1s), so :func:`_chunk_sum` halves the chunk with reductions over axis 0 and no
    reshape of register data (a reshape per halving moved every value through shared memory and spilled)."""
    b = tl.arange(0, 2)
    return (b[:, None, None, None, None, None, None, None] * 128 + b[None, :, None, None, None, None, None, None] * 64
            + b[None, None, :, None, None, None, None, None] * 32 + b[None, None, None, :, None, None, None, None] * 16
            + b[None, None, None, None, :, None, None, None] * 8 + b[None, None, None, None, None, :, None, None] * 4
            + b[None, None, None, None, None, None, :, None] * 2 + b[None, None, None, None, None, None, None, :])


@triton.jit
def _chunk_sum(x):
    """Canonical halving sum (module docstring) of a chunk ``x`` laid out by :func:`_chunk_ids`: the bits
    :func:`chunk_sums` gives. Each reduction over an axis of 2 is one addition per pair: x[i] + x[i + h]."""
    x = tl.sum(x, axis=0)  # h = 128
    x = tl.sum(x, axis=0)  # 64
    x = tl.sum(x, axis=0)  # 32
    x = tl.sum(x, axis=0)  # 16
    x = tl.sum(x, axis=0)  # 8
    x = tl.sum(x, axis=0)  # 4
    x = tl.sum(x, axis=0)  # 2
    return tl.sum(x, axis=0)  # 1


@triton.jit
def _pick_in_chunk(local, t, base, mass):
    """The lane (int32) of a (256,) chunk of weights ``local`` holding the token for threshold ``t`` (float64),
    ``base`` = cum before the chunk and ``mass`` = its fp32 canonical sum: the first lane whose float64 running
    sum passes the rescaled threshold (``L_i * S_c > (t - base) * L_last``: no float64 division, which ptxas
    compiles to a subroutine call with a stack frame), else (rounding) the last lane with weight, else 0."""
    lanes = tl.arange(0, _CDF_CHUNK)
    running = tl.cumsum(local.to(tl.float64), axis=0)
    limit = (t - base) * tl.max(running, axis=0)  # running is nondecreasing: its max is L_last
    first = tl.min(tl.where(running * mass.to(tl.float64) > limit, lanes, _CDF_CHUNK), axis=0)
    last = tl.max(tl.where(local > 0.0, lanes, 0), axis=0)
    return tl.where(first < _CDF_CHUNK, first, last)
