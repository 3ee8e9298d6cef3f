"""Categorical sampling by inverse CDF: one uniform per row, the first token whose cumulative weight exceeds it.

The contract (docs/architecture.md, "Randomness"): a row of non-negative weights ``w [V]`` (a standardized p, a
draft's q, a verification residual; it need not sum to 1) and one uniform ``U`` in (0, 1) from
:func:`specdec.kernels.philox.draw_uniforms` give the token ``i`` with ``C(i - 1) <= U * total < C(i)``, ``C`` the
cumulative sum of ``w`` in token-id order and ``total = C(V - 1)``: token i is drawn with probability
``w_i / total``, and a token of weight 0 never (its interval is empty). One Philox evaluation per row instead of
a V-wide noise row (the exponential race ``argmax(w / E)`` it replaces cost 7-20 ns per element on CPU).

How the cumulative sum is computed (the torch code here runs on CPU and CUDA tensors alike, the same way on both;
the canonical chunk order keeps a kernel port able to pick the same token - the verification kernels, which
draw their correction / bonus token by the exponential race instead, see docs/kernels.md):

- Chunks of ``CDF_CHUNK`` = 256 ids (the last one zero-padded). A chunk's weight ``S_c`` is an fp32 sum in one
  canonical order, not "whatever order a reduction uses": halve the chunk, add element i to element i + h, and
  repeat (h = 128, 64, ..., 1). Each step is an elementwise IEEE addition, so torch on CPU and on CUDA (in-place
  strided adds) produce the same bits. A reduction in a free order would differ in the last bit between devices
  and move the chunk boundaries by ~1e-7: a token mismatch in ~1e-6 of the draws at V = 128K. (One read of the
  row on CPU, no [R, V] temporary: 2-8x a plain ``sum``, far below the noise it
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
  callers flag such rows).

Where CPU and CUDA may still differ: float64 rounding only (``torch.cumsum`` on CUDA scans in parallel), so a token
mismatch needs a threshold within ~1e-16 of a boundary. The uniform has 46 random bits (2**-46 ~ 1.4e-14), far
finer than fp32 probabilities.

Two implementations of the one contract: the torch functions here (``sample_inverse_cdf_reference``: the CPU path
and the oracle) and the Triton kernel (``sample_inverse_cdf``: the Philox draw and the two-level search in one
launch, one program per row, the CUDA path through ``specdec.ops``). The torch form is ~200 small ops (Philox's
rounds alone are ~150); on an H200 plain decoding at T = 0.8 ran 2.6x slower than greedy with it
(bench/results/gpu_h200_20261128_real/). The kernel reads the row twice - pass 1 the total, pass 2 the chunk
(each chunk's canonical sum recomputed: the same bits) - then the chunk once more for its lanes.
"""

from __future__ import annotations

import torch

from specdec.kernels._triton import tl, triton
from specdec.kernels.philox import draw_uniforms, philox_uniform_tl

CDF_CHUNK = 256  # ids per chunk of the two-level search (a power of two; part of the contract, see above)
BELOW_ONE = 1.0 - 2.0**-53  # total * BELOW_ONE is the largest float64 below a (normal, > 0) total
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


def sample_inverse_cdf_reference(weights: torch.Tensor, seeds: torch.Tensor, positions: torch.Tensor,
                                 stream: int) -> torch.Tensor:
    """Exact categorical sampling of each row of ``weights [R, V]`` (non-negative, unnormalised) with its one
    uniform from Philox(seed, position, stream): int64 ``[R]`` on ``weights``' device (``seeds``, ``positions``:
    int64 ``[R]``)."""
    _check_sample_args(weights, seeds, positions)
    return inverse_cdf(weights, draw_uniforms(seeds.to(weights.device), positions.to(weights.device), stream))


def _check_sample_args(weights: torch.Tensor, seeds: torch.Tensor, positions: torch.Tensor) -> None:
    if seeds.shape != (weights.shape[0],) or positions.shape != seeds.shape:
        raise ValueError(f"sample_inverse_cdf needs seeds, positions [R] for weights [R, V]; got weights "
                         f"{tuple(weights.shape)}, seeds {tuple(seeds.shape)}, positions {tuple(positions.shape)}")


# ------------------------------------------------------------------------------------------------- Triton


@triton.jit
def _chunk_sum(w):
    """The canonical halving sum of one chunk ``w`` fp32 [256] (module docstring): each step adds element i to
    element i + h as one IEEE addition (a sum over an axis of length 2), h = 128 down to 1."""
    x = tl.sum(tl.reshape(w, (2, 128)), axis=0)
    x = tl.sum(tl.reshape(x, (2, 64)), axis=0)
    x = tl.sum(tl.reshape(x, (2, 32)), axis=0)
    x = tl.sum(tl.reshape(x, (2, 16)), axis=0)
    x = tl.sum(tl.reshape(x, (2, 8)), axis=0)
    x = tl.sum(tl.reshape(x, (2, 4)), axis=0)
    x = tl.sum(tl.reshape(x, (2, 2)), axis=0)
    x = tl.sum(tl.reshape(x, (2, 1)), axis=0)
    return tl.sum(x, axis=0)


@triton.jit
def _sample_inverse_cdf_kernel(
    weights_ptr,  # fp32 [R, V], unit column stride
    seeds_ptr,  # int64 [R]
    positions_ptr,  # int64 [R]
    out_ptr,  # int64 [R]
    row_stride,
    vocab,
    stream,
    CHUNK: tl.constexpr,  # CDF_CHUNK (the canonical sum is written out for 256)
):
    row = tl.program_id(0).to(tl.int64)
    seed = tl.load(seeds_ptr + row)
    position = tl.load(positions_ptr + row)
    word = tl.arange(0, 2)
    u01 = philox_uniform_tl(seed, position, stream, word)  # fp32 [2]: the block's words 0 and 1
    u0 = tl.sum(tl.where(word == 0, u01, 0.0), axis=0).to(tl.float64)
    u1 = tl.sum(tl.where(word == 1, u01, 0.0), axis=0).to(tl.float64)
    u = u0 + (u1 - 0.5) * 1.1920928955078125e-07  # uniforms_to_draw: 2**-23
    row_ptr = weights_ptr + row * row_stride
    lanes = tl.arange(0, CHUNK)
    num_chunks = tl.cdiv(vocab, CHUNK)
    # pass 1: the total, chunk by chunk in float64 (the reference's sequential cumsum)
    total = tl.zeros((), dtype=tl.float64)
    for c in range(0, num_chunks):
        ids = c * CHUNK + lanes
        total += _chunk_sum(tl.load(row_ptr + ids, mask=ids < vocab, other=0.0)).to(tl.float64)
    capped = total * 0.9999999999999999  # BELOW_ONE = 1 - 2**-53
    t = u * total
    t = tl.where(t < capped, t, capped)  # NaN / inf totals stay NaN / inf: no chunk passes
    # pass 2: the first chunk c with cum_c > t, its cum_(c-1) and its sum
    cum = tl.zeros((), dtype=tl.float64)
    base = tl.zeros((), dtype=tl.float64)
    mass = tl.zeros((), dtype=tl.float32)
    chunk = tl.full((), -1, dtype=tl.int32)
    for c in range(0, num_chunks):
        ids = c * CHUNK + lanes
        s = _chunk_sum(tl.load(row_ptr + ids, mask=ids < vocab, other=0.0))
        after = cum + s.to(tl.float64)
        hit = (after > t) & (chunk < 0)
        chunk = tl.where(hit, c, chunk)
        base = tl.where(hit, cum, base)
        mass = tl.where(hit, s, mass)
        cum = after
    found = chunk >= 0
    chunk = tl.maximum(chunk, 0)
    ids = chunk * CHUNK + lanes
    local = tl.load(row_ptr + ids, mask=ids < vocab, other=0.0)  # fp32 [CHUNK]
    running = tl.cumsum(local.to(tl.float64), axis=0)  # L
    last = tl.sum(tl.where(lanes == CHUNK - 1, running, 0.0), axis=0)  # L_last
    lane = tl.sum((running * mass.to(tl.float64) <= (t - base) * last).to(tl.int32), axis=0)
    lane = tl.minimum(lane, tl.max(tl.where(local > 0, lanes, 0), axis=0))  # never a zero-weight token
    token = tl.where(found, chunk * CHUNK + lane, 0)
    tl.store(out_ptr + row, token.to(tl.int64))


def sample_inverse_cdf(weights: torch.Tensor, seeds: torch.Tensor, positions: torch.Tensor,
                       stream: int) -> torch.Tensor:
    """Triton form of :func:`sample_inverse_cdf_reference` (same arguments and result): one launch, no host read.
    The same token as the reference but where float64 rounding of a chunk's running sum puts the threshold on a
    boundary (module docstring)."""
    _check_sample_args(weights, seeds, positions)
    if weights.dim() != 2 or weights.shape[-1] < 1:
        raise ValueError(f"sample_inverse_cdf needs weights [R, V] with V >= 1; got {tuple(weights.shape)}")
    weights = weights.to(torch.float32)
    if weights.stride(-1) != 1:
        weights = weights.contiguous()
    rows, vocab = weights.shape
    out = torch.empty(rows, dtype=torch.int64, device=weights.device)
    if rows == 0:
        return out
    seeds = seeds.to(device=weights.device, dtype=torch.int64).contiguous()
    positions = positions.to(device=weights.device, dtype=torch.int64).contiguous()
    _sample_inverse_cdf_kernel[(rows,)](weights, seeds, positions, out, weights.stride(0), vocab, stream,
                                        CHUNK=CDF_CHUNK, num_warps=4)  # fmt: skip
    return out


def _last_positive(x: torch.Tensor) -> torch.Tensor:
    """int64 ``[R]``: the last column of ``x [R, N]`` holding a value > 0, or 0 where there is none."""
    cols = torch.arange(x.shape[-1], device=x.device)
    return torch.where(x > 0, cols, 0).amax(dim=-1)
