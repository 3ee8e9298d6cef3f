"""Counter-based randomness shared by the Triton kernels and their torch references.

The randomness contract (docs/architecture.md): every random draw is a pure function of
``(request seed, absolute token position, stream, index)`` through Philox4x32-10, so a seeded request gives
the same tokens whatever it is batched with, and a kernel and its reference draw bit-identical uniforms.

Counter layout: key = seed (uint64 split into two uint32 words), counter = (index, position_lo, position_hi,
stream). The first output word becomes a uniform in the open interval (0, 1):
``u = ((x >> 9) * 2 + 1) * 2**-24`` - exact in fp32, never 0 and never 1, so ``-log(u)`` is finite and > 0.
"""

import torch
import triton
import triton.language as tl

# Streams: one per kind of draw, so two draws at the same position never share numbers.
STREAM_SAMPLE = 0  # plain sampling of the next token (target-only decoding)
STREAM_DRAFT = 1  # a draft model sampling its proposal from q
STREAM_ACCEPT = 2  # the accept/reject uniform of a draft token
STREAM_RESIDUAL = 3  # residual (recovered) token after a rejection, or the bonus token

_MASK32 = 0xFFFFFFFF
_ROUND_A = 0xD2511F53
_ROUND_B = 0xCD9E8D57
_KEY_A = 0x9E3779B9
_KEY_B = 0xBB67AE85
_N_ROUNDS = 10


def _mul_hi_lo(a: torch.Tensor, b: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(hi32, lo32) of the 64-bit product a * b for a, b < 2**32, in int64 without overflow."""
    b_hi, b_lo = b >> 16, b & 0xFFFF
    p_hi = a * b_hi  # < 2**48
    p_lo = a * b_lo  # < 2**48
    hi = (p_hi + (p_lo >> 16)) >> 16
    lo = (((p_hi & 0xFFFF) << 16) + p_lo) & _MASK32
    return hi, lo


def philox_uint32(seed: torch.Tensor, position: torch.Tensor, stream: int, index: torch.Tensor) -> torch.Tensor:
    """Philox4x32-10 first output word, computed in int64 torch arithmetic.

    Args:
        seed: int64, broadcastable; bits are read as an unsigned 64-bit key.
        position: int64 absolute token position, broadcastable (must be >= 0).
        stream: one of the ``STREAM_*`` constants.
        index: int64 index within the draw (vocabulary id for noise over a row, 0 for a single uniform).
    Returns:
        int64 tensor of the broadcast shape holding values in [0, 2**32).
    """
    seed, position, index = torch.broadcast_tensors(seed.long(), position.long(), index.long())
    k0 = seed & _MASK32
    k1 = (seed >> 32) & _MASK32
    c0 = index & _MASK32
    c1 = position & _MASK32
    c2 = (position >> 32) & _MASK32
    c3 = torch.full_like(c0, stream & _MASK32)
    for _ in range(_N_ROUNDS):
        hi_b, lo_b = _mul_hi_lo(c2, _ROUND_B)
        hi_a, lo_a = _mul_hi_lo(c0, _ROUND_A)
        c0, c1, c2, c3 = hi_b ^ c1 ^ k0, lo_b, hi_a ^ c3 ^ k1, lo_a
        k0 = (k0 + _KEY_A) & _MASK32
        k1 = (k1 + _KEY_B) & _MASK32
    return c0


def uint32_to_uniform(x: torch.Tensor) -> torch.Tensor:
    """Map uint32 values (held in int64) to fp32 uniforms in (0, 1), exactly as the kernels do."""
    return ((x >> 9) * 2 + 1).to(torch.float32) * (2.0**-24)


def philox_uniform(seed: torch.Tensor, position: torch.Tensor, stream: int, index: torch.Tensor) -> torch.Tensor:
    """Uniforms in (0, 1), fp32, for the given (seed, position, stream, index) (all broadcast together)."""
    return uint32_to_uniform(philox_uint32(seed, position, stream, index))


def row_uniforms(seeds: torch.Tensor, positions: torch.Tensor, stream: int, n: int) -> torch.Tensor:
    """Uniforms for ``n`` indices per row: ``[R, n]`` fp32 from ``seeds [R]`` and ``positions [R]`` (int64)."""
    index = torch.arange(n, dtype=torch.int64, device=seeds.device)
    return philox_uniform(seeds.long()[:, None], positions.long()[:, None], stream, index[None, :])


def row_exponentials(seeds: torch.Tensor, positions: torch.Tensor, stream: int, n: int) -> torch.Tensor:
    """Exp(1) noise ``[R, n]`` fp32 for ``argmax(p / E)`` sampling (exact categorical sampling, no normalising)."""
    return -torch.log(row_uniforms(seeds, positions, stream, n))


@triton.jit
def philox_uniform_tl(seed, position, stream, index):
    """Triton twin of :func:`philox_uniform`; ``seed``/``position`` int64 scalars, ``index`` an int tensor."""
    seed_u = seed.to(tl.int64).to(tl.uint64, bitcast=True)
    k0 = (seed_u & 0xFFFFFFFF).to(tl.uint32)
    k1 = ((seed_u >> 32) & 0xFFFFFFFF).to(tl.uint32)
    pos_u = position.to(tl.int64).to(tl.uint64, bitcast=True)
    c0 = index.to(tl.uint32)
    c1 = (pos_u & 0xFFFFFFFF).to(tl.uint32) + tl.zeros_like(c0)
    c2 = ((pos_u >> 32) & 0xFFFFFFFF).to(tl.uint32) + tl.zeros_like(c0)
    c3 = stream + tl.zeros_like(c0)
    for _ in tl.static_range(10):
        _c0 = c0
        _c2 = c2
        c0 = tl.umulhi(_c2, 0xCD9E8D57) ^ c1 ^ k0
        c2 = tl.umulhi(_c0, 0xD2511F53) ^ c3 ^ k1
        c1 = _c2 * 0xCD9E8D57
        c3 = _c0 * 0xD2511F53
        k0 = k0 + 0x9E3779B9
        k1 = k1 + 0xBB67AE85
    return ((c0 >> 9) * 2 + 1).to(tl.float32) * 5.9604644775390625e-08
