"""Counter-based randomness shared by the Triton kernels and their torch references.

The randomness contract (docs/architecture.md): every random draw is a pure function of
``(request seed, absolute token position, stream, index)`` through Philox4x32-10, so a seeded request gives
the same tokens whatever it is batched with, and a kernel and its reference draw bit-identical uniforms.

Counter layout: key = seed (uint64 split into two uint32 words), counter = (index // 4, position_lo,
position_hi, stream); index i takes output word ``i % 4`` of that counter's block, so one Philox evaluation
serves four consecutive indices. A word becomes a uniform in the open interval (0, 1):
``u = ((x >> 9) * 2 + 1) * 2**-24`` - exact in fp32, never 0 and never 1, so ``-log(u)`` is finite and > 0.

NOTE: the CPU reference computes Philox in numpy uint64 arithmetic (a 32x32-bit product fits in 64 bits, so
``umulhi`` is a shift); it is the hot part of CPU sampling (one draw per vocabulary entry per sampled token).
"""

import numpy as np
import torch
from specdec.kernels._triton import tl, triton

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


_U32 = np.uint64(_MASK32)
_SHIFT = np.uint64(32)


def _philox4_numpy(seed: np.ndarray, position: np.ndarray, stream: int, counter: np.ndarray):
    """The four Philox4x32-10 output words for uint64 arrays of seed bits, positions and counters."""
    k0, k1 = seed & _U32, seed >> _SHIFT
    c0, c1, c2 = counter & _U32, position & _U32, position >> _SHIFT
    c3 = np.full_like(c0, stream & _MASK32)
    round_a, round_b = np.uint64(_ROUND_A), np.uint64(_ROUND_B)
    key_a, key_b = np.uint64(_KEY_A), np.uint64(_KEY_B)
    for _ in range(_N_ROUNDS):
        prod_b = c2 * round_b  # < 2**64: exact
        prod_a = c0 * round_a
        c0, c1, c2, c3 = (prod_b >> _SHIFT) ^ c1 ^ k0, prod_b & _U32, (prod_a >> _SHIFT) ^ c3 ^ k1, prod_a & _U32
        k0 = (k0 + key_a) & _U32
        k1 = (k1 + key_b) & _U32
    return c0, c1, c2, c3


def philox_uint32(seed: torch.Tensor, position: torch.Tensor, stream: int, index: torch.Tensor) -> torch.Tensor:
    """Philox4x32-10 word for each (seed, position, stream, index), broadcast together.

    Args:
        seed: int64, broadcastable; bits are read as an unsigned 64-bit key.
        position: int64 absolute token position, broadcastable (must be >= 0).
        stream: one of the ``STREAM_*`` constants.
        index: int64 index within the draw (vocabulary id for noise over a row, 0 for a single uniform).
    Returns:
        int64 tensor of the broadcast shape (on ``index``'s device) holding values in [0, 2**32).
    """
    device = index.device
    seed, position, index = torch.broadcast_tensors(seed.long().cpu(), position.long().cpu(), index.long().cpu())
    as_u64 = lambda t: t.contiguous().numpy().view(np.uint64)  # noqa: E731 - int64 bits reinterpreted
    idx = as_u64(index)
    words = _philox4_numpy(as_u64(seed), as_u64(position), stream, idx >> np.uint64(2))
    lane = (idx & np.uint64(3)).astype(np.int64)
    out = np.choose(lane, words)
    return torch.from_numpy(out.astype(np.int64)).to(device)


def uint32_to_uniform(x: torch.Tensor) -> torch.Tensor:
    """Map uint32 values (held in int64) to fp32 uniforms in (0, 1), exactly as the kernels do."""
    return ((x >> 9) * 2 + 1).to(torch.float32) * (2.0**-24)


def philox_uniform(seed: torch.Tensor, position: torch.Tensor, stream: int, index: torch.Tensor) -> torch.Tensor:
    """Uniforms in (0, 1), fp32, for the given (seed, position, stream, index) (all broadcast together)."""
    return uint32_to_uniform(philox_uint32(seed, position, stream, index))


def row_uniforms(seeds: torch.Tensor, positions: torch.Tensor, stream: int, n: int) -> torch.Tensor:
    """Uniforms for indices ``0..n-1`` per row: ``[R, n]`` fp32 from ``seeds [R]`` and ``positions [R]`` (int64).

    Same numbers as :func:`philox_uniform` with ``index = arange(n)``, computed one Philox block per 4 indices.
    """
    device = seeds.device
    as_u64 = lambda t: t.long().cpu().contiguous().numpy().view(np.uint64)[:, None]  # noqa: E731
    counters = np.arange((n + 3) // 4, dtype=np.uint64)[None, :]  # (1, ceil(n/4))
    seed, position = as_u64(seeds), as_u64(positions)  # (R, 1)
    blocks = np.broadcast_to(counters, (seed.shape[0], counters.shape[1]))
    words = _philox4_numpy(seed, position, stream, blocks)  # 4 x (R, ceil(n/4))
    # (R, n): index i is word i % 4 of block i // 4
    bits = np.stack(words, axis=-1).reshape(seed.shape[0], 4 * counters.shape[1])[:, :n]
    u = ((bits >> np.uint64(9)) * np.uint64(2) + np.uint64(1)).astype(np.float32) * np.float32(2.0**-24)
    return torch.from_numpy(u).to(device)


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
    lane = index % 4
    c0 = (index // 4).to(tl.uint32)
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
    word = tl.where(lane == 0, c0, tl.where(lane == 1, c1, tl.where(lane == 2, c2, c3)))
    return ((word >> 9) * 2 + 1).to(tl.float32) * 5.9604644775390625e-08
