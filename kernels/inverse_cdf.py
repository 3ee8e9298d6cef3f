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
"""

from __future__ import annotations

import torch

from specdec.kernels.philox import draw_uniforms

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
