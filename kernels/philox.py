"""Counter-based randomness shared by the Triton kernels and their torch references.

The randomness contract (docs/architecture.md): every random draw is a pure function of
``(request seed, absolute token position, stream, index)`` through Philox4x32-10, so a seeded request gives
the same tokens whatever it is batched with, and a kernel and its reference draw bit-identical uniforms.

Counter layout: key = seed (uint64 split into two uint32 words), counter = (index // 4, position_lo,
position_hi, stream); index i takes output word ``i % 4`` of that counter's block, so one Philox evaluation
serves four consecutive indices. A word becomes a uniform in the open interval (0, 1):
``u = ((x >> 9) * 2 + 1) * 2**-24`` - exact in fp32, never 0 and never 1, so ``-log(u)`` is finite and > 0.

Two host-side twins, bit-identical (tests/kernels/test_philox.py, with the published Philox4x32-10 known-answer
vectors): ``philox4x32`` in torch int64 arithmetic runs on the tensors' own device - the path for CUDA tensors,
so noise over a vocabulary never crosses to the host (a 32x32-bit product does not fit a signed 64-bit integer,
so ``umulhi`` is assembled from two 32x16-bit products); ``_philox4x32_numpy`` in uint64 arithmetic is the path
for CPU tensors, because eager torch needs ~1.8x the elementwise passes and measured 1.2-2.4x slower than numpy
there (1 thread, V = 32000 and 151936, rows 1 and 8).
"""

import numpy as np
import torch

from specdec.kernels._triton import tl, triton

# Streams: one per kind of draw, so two draws at the same position never share numbers.
STREAM_SAMPLE = 0  # plain sampling of the next token (target-only decoding)
STREAM_DRAFT = 1  # a draft model sampling its proposal from q
STREAM_ACCEPT = 2  # the accept/reject uniform of a draft token
STREAM_RESIDUAL = 3  # residual (recovered) token after a rejection, or the bonus token
STREAM_BLOCK_ACCEPT = 4  # block verification's stop uniforms, keyed by the round (kernels/block_verify.py)


def round_stream(stream: int, offset: int) -> int:
    """The stream word of draw ``offset`` (>= 0) of a round whose draws are keyed by the round's start position
    instead of each draw's own position: ``stream | (offset + 1) << 16``, distinct from every plain stream.
    Block verification needs drafts drawn this way (kernels/block_verify.py, "Drafts")."""
    return stream | (offset + 1) << 16


_MASK32 = 0xFFFFFFFF
_ROUND_A = 0xD2511F53
_ROUND_B = 0xCD9E8D57
_KEY_A = 0x9E3779B9
_KEY_B = 0xBB67AE85
_N_ROUNDS = 10


def _mulhilo(x: torch.Tensor, m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(hi, lo) 32-bit words of ``x * m`` for uint32 values ``x`` held in int64 and a uint32 constant ``m``."""
    m_hi, m_lo = m >> 16, m & 0xFFFF
    hi = (x * m_hi + ((x * m_lo) >> 16)) >> 16  # each product < 2**48: exact in int64
    lo = (x * m) & _MASK32  # int64 multiplication wraps; the low 32 bits are exact
    return hi, lo


def philox4x32(key: tuple[torch.Tensor, torch.Tensor], counter: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
    """Philox4x32-10 (Salmon et al., SC'11): the four output words for uint32 key and counter words held in
    int64 tensors (broadcast together), on their own device."""
    k0, k1 = key
    c0, c1, c2, c3 = counter
    for _ in range(_N_ROUNDS):
        hi_b, lo_b = _mulhilo(c2, _ROUND_B)
        hi_a, lo_a = _mulhilo(c0, _ROUND_A)
        c0, c1, c2, c3 = hi_b ^ c1 ^ k0, lo_b, hi_a ^ c3 ^ k1, lo_a
        k0 = (k0 + _KEY_A) & _MASK32
        k1 = (k1 + _KEY_B) & _MASK32
    return c0, c1, c2, c3


def _philox4x32_numpy(key: tuple[np.ndarray, np.ndarray], counter: tuple[np.ndarray, ...]) -> tuple[np.ndarray, ...]:
    """:func:`philox4x32` on uint64 arrays holding uint32 words (a 32x32-bit product fits in 64 bits)."""
    k0, k1 = key
    c0, c1, c2, c3 = counter
    mask, shift = np.uint64(_MASK32), np.uint64(32)
    round_a, round_b, key_a, key_b = (np.uint64(v) for v in (_ROUND_A, _ROUND_B, _KEY_A, _KEY_B))
    for _ in range(_N_ROUNDS):
        prod_b = c2 * round_b
        prod_a = c0 * round_a
        c0, c1, c2, c3 = (prod_b >> shift) ^ c1 ^ k0, prod_b & mask, (prod_a >> shift) ^ c3 ^ k1, prod_a & mask
        k0 = (k0 + key_a) & mask
        k1 = (k1 + key_b) & mask
    return c0, c1, c2, c3


def _words(seed: torch.Tensor, position: torch.Tensor, stream: int, block: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """The contract's counter layout: key = seed bits, counter = (block, position lo, position hi, stream)."""
    key = (seed & _MASK32, (seed >> 32) & _MASK32)  # arithmetic shift + mask = the unsigned high word
    counter = (block, position & _MASK32, (position >> 32) & _MASK32, torch.full_like(block, stream & _MASK32))
    return philox4x32(key, counter)


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
    seed, position, index = torch.broadcast_tensors(seed.long().to(device), position.long().to(device), index.long())
    words = _words(seed, position, stream, index >> 2)
    lane = index & 3
    return torch.stack(words, dim=-1).gather(-1, lane.unsqueeze(-1)).squeeze(-1)


def uint32_to_uniform(x: torch.Tensor) -> torch.Tensor:
    """Map uint32 values (held in int64) to fp32 uniforms in (0, 1), exactly as the kernels do."""
    return ((x >> 9) * 2 + 1).to(torch.float32) * (2.0**-24)


def philox_uniform(seed: torch.Tensor, position: torch.Tensor, stream: int, index: torch.Tensor) -> torch.Tensor:
    """Uniforms in (0, 1), fp32, for the given (seed, position, stream, index) (all broadcast together)."""
    return uint32_to_uniform(philox_uint32(seed, position, stream, index))


def row_uniforms(seeds: torch.Tensor, positions: torch.Tensor, stream: int, n: int) -> torch.Tensor:
    """Uniforms for indices ``0..n-1`` per row: ``[R, n]`` fp32 from ``seeds [R]`` and ``positions [R]`` (int64),
    on ``seeds``' device.

    Same numbers as :func:`philox_uniform` with ``index = arange(n)``, computed one Philox block per 4 indices.
    """
    if not seeds.is_cuda:
        return _row_uniforms_numpy(seeds, positions, stream, n)
    device = seeds.device
    rows = seeds.shape[0]
    blocks = torch.arange((n + 3) // 4, dtype=torch.int64, device=device)[None, :]  # (1, ceil(n/4))
    seed = seeds.long()[:, None]  # (R, 1)
    position = positions.long().to(device)[:, None]
    words = _words(seed, position, stream, blocks.expand(rows, -1))  # 4 x (R, ceil(n/4))
    bits = torch.stack(words, dim=-1).reshape(rows, 4 * blocks.shape[1])[:, :n]  # (R, n): word i % 4 of block i // 4
    return uint32_to_uniform(bits)


def _row_uniforms_numpy(seeds: torch.Tensor, positions: torch.Tensor, stream: int, n: int) -> torch.Tensor:
    """:func:`row_uniforms` for CPU tensors, in numpy uint64 arithmetic (the faster host path)."""
    as_u64 = lambda t: t.long().contiguous().numpy().view(np.uint64)[:, None]  # noqa: E731 - int64 bits
    seed, position = as_u64(seeds), as_u64(positions)  # (R, 1)
    mask, shift = np.uint64(_MASK32), np.uint64(32)
    blocks = np.broadcast_to(np.arange((n + 3) // 4, dtype=np.uint64)[None, :], (seed.shape[0], (n + 3) // 4))
    words = _philox4x32_numpy((seed & mask, seed >> shift),
                              (blocks, position & mask, position >> shift, np.full_like(blocks, stream & _MASK32)))
    bits = np.stack(words, axis=-1).reshape(seed.shape[0], 4 * blocks.shape[1])[:, :n]  # (R, n)
    u = ((bits >> np.uint64(9)) * np.uint64(2) + np.uint64(1)).astype(np.float32) * np.float32(2.0**-24)
    return torch.from_numpy(u)


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
