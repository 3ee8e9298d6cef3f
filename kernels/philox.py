"""Counter-based randomness shared by the Triton kernels and their torch references.

The randomness contract (docs/architecture.md): every random draw is a pure function of
``(request seed, absolute token position, stream, index)`` through Philox4x32-10, so a seeded request gives
the same tokens whatever it is batched with, and a kernel and its reference draw bit-identical uniforms.

Counter layout: key = seed (uint64 split into two uint32 words), counter = (index // 4, position_lo,
position_hi, stream); index i takes output word ``i % 4`` of that counter's block, so one Philox evaluation
serves four consecutive indices. A word becomes a uniform in the open interval (0, 1):
``u = ((x >> 9) * 2 + 1) * 2**-24`` - exact in fp32, never 0 and never 1, so ``-log(u)`` is finite and > 0.

One torch implementation, ``philox4x32`` in int64 arithmetic, bit-identical to the Triton twin and to the
published Philox4x32-10 known-answer vectors (tests/kernels/test_philox.py, with a numpy oracle). It never
overflows int64: a 32x32-bit product is assembled from two 32x16-bit products (< 2**48), because the CPU path
compiles it to C++, where a signed overflow is undefined behaviour that gcc exploits (measured: whole rows of
wrong words). Noise over a vocabulary is drawn on the tensors' device, never on the host:

- CUDA: the int64 torch code on the device (and the Triton twin inside the kernels);
- CPU: the same code compiled by ``torch.compile`` (Inductor's C++ backend: one fused loop instead of ~80
  elementwise passes; ``python -m bench.costs.philox_cpu``, 1 thread: 1.5-6x faster than the numpy path it replaces
  and 3-11x faster than eager torch, the larger gains on the larger rows), called per chunk of
  ``_CPU_CHUNK_BLOCKS`` Philox blocks so its buffers stay in cache. Shapes are dynamic (one compilation per
  process, tens of seconds cold, seconds from Inductor's on-disk cache), made in a background thread started after
  ``COMPILE_AFTER_CALLS`` eager noise calls (or by :func:`warm_up_cpu_noise`): until it is ready the same code runs
  eagerly, so no request waits for the compiler and the numbers are the same either way. Without a working
  compiler it warns once and stays eager (same bits, slower). Only the integer part is compiled: ``-log(u)`` and
  the division stay eager torch, so a sampled token is bit-for-bit the argmax an unfused reference computes.
  (No numpy on this path any more; the numpy twin lives on in the tests as an oracle.)

Two kinds of draw use it. A categorical draw takes ONE uniform per row, :func:`draw_uniforms` (46 random bits from
indices 0 and 1 of (seed, position, stream): one Philox block), which ``specdec.kernels.inverse_cdf`` turns into a
token - the plain sampler and a draft model's chains. Noise over a whole row (:func:`row_uniforms`,
:func:`row_exponentials`) is left to what one uniform does not do: the tree drafter's children drawn without
replacement (the top-c of ``q / E``, Gumbel-top-c), and the verification kernels' correction / bonus token
(``argmax(r / E)``, kernels/spec_sample.py: an inverse-CDF port of those kernels was 5x slower on an H200 and
disagreed with its reference inside a chunk; docs/kernels.md). :func:`sample_argmax` (``argmax(p / E)`` per row
without materialising ``[R, V]`` noise on the CPU) is the exponential race the sampler used before the inverse
CDF; nothing on the decoding path calls it now (``bench.costs.philox_cpu`` times it).

Over 300 lines because the counter-based generator's Triton and torch forms must stay bit-identical, so they are
kept side by side.
"""

import sys
import threading
import warnings

import torch

from specdec.kernels._triton import tl, triton

# Streams: one per kind of draw, so two draws at the same position never share numbers.
STREAM_SAMPLE = 0  # plain sampling of the next token (target-only decoding)
STREAM_DRAFT = 1  # a draft model sampling its proposal from q
STREAM_ACCEPT = 2  # the accept/reject uniform of a draft token
STREAM_RESIDUAL = 3  # correction token after a rejection (drawn from the residual distribution), or the bonus token
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
    """(hi, lo) 32-bit words of ``x * m`` for uint32 values ``x`` held in int64 and a uint32 constant ``m``.

    Never overflows int64 (see the module docstring): ``x * m = high * 2**16 + low`` with both products < 2**48."""
    low = x * (m & 0xFFFF)
    high = x * (m >> 16)
    return (high + (low >> 16)) >> 16, (low + ((high & 0xFFFF) << 16)) & _MASK32


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


def _block_uniforms(seeds: torch.Tensor, positions: torch.Tensor, stream, first_block, num_blocks: int) -> torch.Tensor:
    """Uniforms of Philox blocks ``first_block .. first_block + num_blocks - 1`` per row: fp32 ``[R, num_blocks, 4]``
    (index ``i`` of a row at ``[r, i // 4 - first_block, i % 4]``) from int64 ``seeds [R]`` and ``positions [R]``.

    ``stream`` and ``first_block`` are ints or 0-d int64 tensors (tensors on the compiled CPU path, so that
    compiling never specialises on their values)."""
    blocks = torch.arange(num_blocks, dtype=torch.int64, device=seeds.device)[None, :] + first_block  # (1, nb)
    seed, position = seeds[:, None], positions[:, None]  # (R, 1)
    key = (seed & _MASK32, (seed >> 32) & _MASK32)  # arithmetic shift + mask = the unsigned high word
    counter = (blocks, position & _MASK32, (position >> 32) & _MASK32, torch.zeros_like(position) + (stream & _MASK32))
    return torch.stack([uint32_to_uniform(w) for w in philox4x32(key, counter)], dim=-1)  # (R, nb, 4)


# The compiled CPU path: one graph for every shape (rows and blocks dynamic; rows unbacked, so 1 row compiles no
# second graph; at least 2 blocks per call for the same reason), compiled in a background thread while eager torch
# draws the same numbers, a lock (the serve engine samples in its own thread) and an eager fallback when
# compiling fails. ~16K blocks per call keeps its int64 temporaries
# (4 x 8 bytes per block) and its output in L2: 1.9-2.7x faster than one call over [64, 128256] / [64, 32000]
# (bench.costs.philox_cpu --chunks 4096 16384 65536 0, two runs under load: 16K and 64K within the noise of each other,
# 4K paying ~70-120 us of dynamo guards per call).
_CPU_CHUNK_BLOCKS = 1 << 14
_cpu_lock = threading.Lock()  # serialises calls of the compiled function
_state_lock = threading.Lock()  # guards starting the compile thread
_cpu_compiled = None  # None: not started or compiling; the compiled _block_uniforms when ready; False if it failed
_cpu_compile_thread: threading.Thread | None = None
# Eager calls before the first sampled step starts the compile thread: a short run (a one-shot CLI call, a script
# sampling a few tokens) never compiles, so it never waits at exit for a compile it does not need (the thread is
# not a daemon: an interpreter that shut down under a running Inductor compile aborted, SIGABRT).
COMPILE_AFTER_CALLS = 64
_cpu_eager_calls = 0


def _compiled_args(seeds, positions, stream, first_block, num_blocks):
    seeds, positions = seeds.clone(), positions.clone()  # not views: dynamo would specialise on a base of 1 row
    return (seeds, positions, torch.tensor(stream, dtype=torch.int64), torch.tensor(first_block, dtype=torch.int64),
            max(num_blocks, 2))


def _call_compiled(fn, args):
    from torch._dynamo.decorators import mark_unbacked  # imported once torch.compile is in use

    mark_unbacked(args[0], 0)
    mark_unbacked(args[1], 0)
    return fn(*args)


def _give_up_compiling(err: Exception) -> None:
    global _cpu_compiled
    _cpu_compiled = False
    # silent once the main thread has ended: at exit the compile fails by itself ("can't register atexit after
    # shutdown") and there is nothing left to draw noise for
    if not sys.is_finalizing() and threading.main_thread().is_alive():
        warnings.warn(f"Philox noise: torch.compile failed ({type(err).__name__}: {err}); drawing CPU noise "
                      "with eager torch from now on (same numbers, slower)", RuntimeWarning, stacklevel=3)


def _compile_cpu_noise() -> None:
    """The compile thread: compile :func:`_block_uniforms` with one call on a 1-row input (the graph is shape-
    generic), then publish it; callers use eager torch (the same numbers) until then."""
    global _cpu_compiled
    try:
        fn = torch.compile(_block_uniforms, dynamic=True)
        one = torch.zeros(1, dtype=torch.int64)
        with _cpu_lock:
            _call_compiled(fn, _compiled_args(one, one, 0, 0, 2))
        _cpu_compiled = fn
    except Exception as err:  # no C++ compiler, an Inductor bug: same numbers, eagerly
        _give_up_compiling(err)


def warm_up_cpu_noise(wait: bool = False) -> bool:
    """Start compiling the CPU noise path in a background thread (once per process; sampling does it by itself
    after ``COMPILE_AFTER_CALLS`` eager noise calls), and with ``wait`` block until it is done. Returns whether the
    compiled path is in use.

    Until the compiled function is ready, noise is drawn by the same code in eager torch: bit-identical numbers,
    slower, and no request ever waits for the compiler (tens of seconds cold). The thread is not a daemon, so a
    process that ends during the compile waits for it at exit. Benchmarks that time sampled steps call this with
    ``wait=True`` first."""
    global _cpu_compile_thread
    with _state_lock:
        if _cpu_compiled is None and _cpu_compile_thread is None:
            _cpu_compile_thread = threading.Thread(target=_compile_cpu_noise, name="specdec-philox-compile")
            _cpu_compile_thread.start()
        thread = _cpu_compile_thread
    if wait and thread is not None:
        thread.join()
    return callable(_cpu_compiled)


def _cpu_block_uniforms(seeds: torch.Tensor, positions: torch.Tensor, stream: int, first_block: int,
                        num_blocks: int) -> torch.Tensor:
    """:func:`_block_uniforms` on CPU tensors, compiled by Inductor once that is ready (eager torch until then, or
    for good if compiling fails): fp32 ``[R, nb, 4]`` with ``nb = max(num_blocks, 2)``."""
    args = _compiled_args(seeds, positions, stream, first_block, num_blocks)
    global _cpu_eager_calls
    fn = _cpu_compiled
    if fn is None:
        _cpu_eager_calls += 1
        if _cpu_eager_calls >= COMPILE_AFTER_CALLS:
            warm_up_cpu_noise()
            fn = _cpu_compiled
    if fn:
        with _cpu_lock:
            try:
                return _call_compiled(fn, args)
            except Exception as err:
                _give_up_compiling(err)
    return _block_uniforms(*args)


def _cpu_piece(num_blocks: int) -> int:
    """Blocks per piece when a row of ``num_blocks`` is cut into near-equal runs of at most a chunk (all of them
    when it fits); a row has ``ceil(num_blocks / piece)`` pieces."""
    return -(-num_blocks // -(-num_blocks // _CPU_CHUNK_BLOCKS)) if num_blocks > _CPU_CHUNK_BLOCKS else num_blocks


def _cpu_chunks(rows: int, num_blocks: int):
    """``(r0, r1, b0, nb, piece)`` chunks covering ``[rows, num_blocks]``: whole rows while they fit in a chunk,
    else one row at a time in :func:`_cpu_piece` runs of blocks, in order (``piece`` counts them from 0)."""
    size = _cpu_piece(num_blocks)
    if size == num_blocks:
        step = _CPU_CHUNK_BLOCKS // max(num_blocks, 1)
        for r0 in range(0, rows, step):
            yield r0, min(rows, r0 + step), 0, num_blocks, 0
        return
    for r0 in range(rows):
        for piece, b0 in enumerate(range(0, num_blocks, size)):
            yield r0, r0 + 1, b0, min(size, num_blocks - b0), piece


def _cpu_row_noise(seeds: torch.Tensor, positions: torch.Tensor, stream: int, n: int,
                   exponential: bool) -> torch.Tensor:
    """:func:`row_uniforms` (or, with ``exponential``, ``-log`` of them) for CPU tensors, chunk by chunk."""
    rows, num_blocks = seeds.shape[0], (n + 3) // 4
    seeds, positions = seeds.long().contiguous(), positions.long().contiguous()
    out = torch.empty(rows, num_blocks, 4)  # (R, nb, 4)
    if rows == 0 or n == 0:
        return out.view(rows, 4 * num_blocks)[:, :n]
    for r0, r1, b0, nb, _ in _cpu_chunks(rows, num_blocks):
        u = _cpu_block_uniforms(seeds[r0:r1], positions[r0:r1], stream, b0, nb)[:, :nb]  # (r1 - r0, nb, 4)
        if exponential:
            out[r0:r1, b0:b0 + nb] = u.log_().neg_()  # -log(u), as the CUDA path computes it
        else:
            out[r0:r1, b0:b0 + nb] = u
    return out.view(rows, 4 * num_blocks)[:, :n]


def row_uniforms(seeds: torch.Tensor, positions: torch.Tensor, stream: int, n: int) -> torch.Tensor:
    """Uniforms for indices ``0..n-1`` per row: ``[R, n]`` fp32 from ``seeds [R]`` and ``positions [R]`` (int64),
    on ``seeds``' device.

    Same numbers as :func:`philox_uniform` with ``index = arange(n)``, computed one Philox block per 4 indices.
    """
    if not seeds.is_cuda:
        return _cpu_row_noise(seeds, positions, stream, n, exponential=False)
    rows, num_blocks = seeds.shape[0], (n + 3) // 4
    u = _block_uniforms(seeds.long(), positions.long().to(seeds.device), stream, 0, num_blocks)  # (R, nb, 4)
    return u.reshape(rows, 4 * num_blocks)[:, :n]


def row_exponentials(seeds: torch.Tensor, positions: torch.Tensor, stream: int, n: int) -> torch.Tensor:
    """Exp(1) noise ``[R, n]`` fp32 for ``argmax(p / E)`` sampling (exact categorical sampling, no normalising)."""
    if not seeds.is_cuda:
        return _cpu_row_noise(seeds, positions, stream, n, exponential=True)
    return -torch.log(row_uniforms(seeds, positions, stream, n))


def uniforms_to_draw(u0: torch.Tensor, u1: torch.Tensor) -> torch.Tensor:
    """One float64 uniform with 46 random bits from two fp32 uniforms: ``u0 + (u1 - 0.5) * 2**-23``.

    Exact in float64: with ``u0 = (2a + 1) 2**-24`` and ``u1 = (2b + 1) 2**-24`` it is ``(2m + 1) 2**-47`` with
    ``m = a * 2**23 + b`` - u1 refines u0's cell of width 2**-23 -, so it lies in (0, 1), never 0 or 1."""
    return u0.to(torch.float64) + (u1.to(torch.float64) - 0.5) * 2.0**-23


def draw_uniforms(seeds: torch.Tensor, positions: torch.Tensor, stream: int) -> torch.Tensor:
    """The one uniform of a draw per row: float64 ``[R]`` in (0, 1) from int64 ``seeds [R]`` and
    ``positions [R]``, on ``seeds``' device - :func:`uniforms_to_draw` of indices 0 and 1 of (seed, position,
    stream), i.e. two words of one Philox block. Inverse-CDF sampling (``specdec.kernels.inverse_cdf``) turns it
    into a token."""
    seeds, positions = seeds.long(), positions.long().to(seeds.device)
    if seeds.shape[0] == 0:
        return torch.zeros(0, dtype=torch.float64, device=seeds.device)
    if seeds.is_cuda:
        u = _block_uniforms(seeds, positions, stream, 0, 1)  # (R, 1, 4)
    else:
        u = _cpu_block_uniforms(seeds.contiguous(), positions.contiguous(), stream, 0, 1)  # (R, 2, 4)
    return uniforms_to_draw(u[:, 0, 0], u[:, 0, 1])


def sample_argmax(probs: torch.Tensor, seeds: torch.Tensor, positions: torch.Tensor, stream: int) -> torch.Tensor:
    """Exact categorical sampling ``argmax(p / E)`` per row, E ~ Exp(1) from Philox(seed, position, stream): int64
    ``[R]`` on ``probs``' device, bit-for-bit ``(probs / row_exponentials(...)).argmax(-1)``.

    Args:
        probs: ``[R, V]`` (V >= 1), non-negative; fp32 or lower (divided in fp32, as the unfused form promotes).
        seeds, positions: int64 ``[R]``.
    On CPU the noise is drawn, divided and reduced a chunk at a time (never an ``[R, V]`` noise tensor); first
    maximum wins ties and a NaN row gives its first NaN's index, as ``argmax`` does.
    """
    if probs.dim() != 2 or probs.shape[-1] < 1 or seeds.shape != (probs.shape[0],) or positions.shape != seeds.shape:
        raise ValueError(f"sample_argmax needs probs [R, V] with V >= 1 and seeds, positions [R]; got probs "
                         f"{tuple(probs.shape)}, seeds {tuple(seeds.shape)}, positions {tuple(positions.shape)}")
    device = probs.device
    seeds, positions = seeds.to(device), positions.to(device)
    if probs.is_cuda:
        return (probs / row_exponentials(seeds, positions, stream, probs.shape[-1])).argmax(dim=-1)
    rows, vocab = probs.shape
    seeds, positions = seeds.long().contiguous(), positions.long().contiguous()
    num_blocks = (vocab + 3) // 4
    pieces = -(-num_blocks // _cpu_piece(num_blocks))
    best = torch.empty(rows, pieces)  # (R, K): each vocabulary piece's maximum of p / E
    where = torch.empty(rows, pieces, dtype=torch.int64)  # (R, K): its first token reaching it
    for r0, r1, b0, nb, piece in _cpu_chunks(rows, num_blocks):
        lo, hi = 4 * b0, min(vocab, 4 * (b0 + nb))
        u = _cpu_block_uniforms(seeds[r0:r1], positions[r0:r1], stream, b0, nb).view(r1 - r0, -1)[:, :hi - lo]
        score = torch.div(probs[r0:r1, lo:hi], u.log_().neg_(), out=u)  # p / E, in place: (r1 - r0, hi - lo)
        value, index = score.max(dim=-1)
        best[r0:r1, piece], where[r0:r1, piece] = value, index + lo
    if pieces == 1:
        return where[:, 0]
    return where.gather(1, best.argmax(dim=-1, keepdim=True)).squeeze(1)  # earliest piece holding the maximum


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
