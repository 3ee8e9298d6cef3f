"""The randomness contract's Philox4x32-10: published known-answer vectors, and its twins bit-identical - the torch
code (eager on the tensors' device; compiled by Inductor for CPU rows, chunk by chunk, eager if that fails), the
Triton twin inside the kernels, and an independent numpy oracle here; ``sample_argmax`` (the fused CPU sampling)
bit-for-bit ``(probs / row_exponentials).argmax``."""

import threading
import warnings

import numpy as np
import pytest
import torch
import triton
import triton.language as tl

from specdec.kernels import philox
from specdec.kernels.philox import (
    philox4x32,
    philox_uniform,
    philox_uniform_tl,
    row_exponentials,
    row_uniforms,
    sample_argmax,
)

# Random123's kat_vectors for philox4x32_10: (key, counter) -> output
KNOWN_ANSWERS = [
    ((0, 0), (0, 0, 0, 0), (0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8)),
    ((0xFFFFFFFF,) * 2, (0xFFFFFFFF,) * 4, (0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD)),
    ((0xA4093822, 0x299F31D0), (0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344),
     (0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1)),
]


def _philox4x32_numpy(key, counter):
    """The oracle: Philox4x32-10 in numpy uint64 arithmetic (a 32x32-bit product fits in 64 bits, unsigned)."""
    k0, k1 = key
    c0, c1, c2, c3 = counter
    mask, shift = np.uint64(0xFFFFFFFF), np.uint64(32)
    round_a, round_b, key_a, key_b = (np.uint64(v) for v in (0xD2511F53, 0xCD9E8D57, 0x9E3779B9, 0xBB67AE85))
    for _ in range(10):
        prod_b, prod_a = c2 * round_b, c0 * round_a
        c0, c1, c2, c3 = (prod_b >> shift) ^ c1 ^ k0, prod_b & mask, (prod_a >> shift) ^ c3 ^ k1, prod_a & mask
        k0, k1 = (k0 + key_a) & mask, (k1 + key_b) & mask
    return c0, c1, c2, c3


def _row_uniforms_numpy(seeds: torch.Tensor, positions: torch.Tensor, stream: int, n: int) -> torch.Tensor:
    """The oracle for :func:`row_uniforms`: fp32 ``[R, n]``, the contract's counter layout written out in numpy."""
    as_u64 = lambda t: t.long().contiguous().numpy().view(np.uint64)[:, None]  # noqa: E731 - int64 bits
    seed, position = as_u64(seeds), as_u64(positions)  # (R, 1)
    mask, shift = np.uint64(0xFFFFFFFF), np.uint64(32)
    blocks = np.broadcast_to(np.arange((n + 3) // 4, dtype=np.uint64)[None, :], (seed.shape[0], (n + 3) // 4))
    words = _philox4x32_numpy((seed & mask, seed >> shift),
                              (blocks, position & mask, position >> shift, np.full_like(blocks, stream)))
    bits = np.stack(words, axis=-1).reshape(seed.shape[0], 4 * blocks.shape[1])[:, :n]  # (R, n)
    u = ((bits >> np.uint64(9)) * np.uint64(2) + np.uint64(1)).astype(np.float32) * np.float32(2.0**-24)
    return torch.from_numpy(u)


@pytest.fixture(params=["compiled", "eager"])
def cpu_path(request, monkeypatch):
    """Run a test on the compiled CPU path and on its eager fallback (``_cpu_compiled = False``)."""
    if request.param == "eager":
        monkeypatch.setattr(philox, "_cpu_compiled", False)
    else:
        assert philox.warm_up_cpu_noise(wait=True), "the compiled CPU noise path is not in use"
    return request.param


@pytest.fixture
def small_chunks(monkeypatch):
    """8 Philox blocks per chunk: rows of more than 32 indices are cut into pieces, shorter ones grouped."""
    monkeypatch.setattr(philox, "_CPU_CHUNK_BLOCKS", 8)


@pytest.mark.parametrize("key,counter,expected", KNOWN_ANSWERS)
def test_known_answers(key, counter, expected):
    as_t = lambda v: torch.tensor(v, dtype=torch.int64)  # noqa: E731
    assert tuple(int(w) for w in philox4x32(tuple(map(as_t, key)), tuple(map(as_t, counter)))) == expected
    as_u = lambda v: np.array([v], dtype=np.uint64)  # noqa: E731
    got = _philox4x32_numpy(tuple(map(as_u, key)), tuple(map(as_u, counter)))
    assert tuple(int(w[0]) for w in got) == expected


def _seeds_and_positions(rows: int):
    g = torch.Generator().manual_seed(0)
    seeds = torch.randint(-(2**63), 2**63 - 1, (rows,), dtype=torch.int64, generator=g)
    seeds[:3] = torch.tensor([0, 2**63 - 1, -1])[:rows]  # the extremes of the key's bits
    positions = torch.randint(0, 2**40, (rows,), dtype=torch.int64, generator=g)
    positions[0] = 0
    return seeds, positions


@pytest.mark.parametrize("n", [1, 3, 4, 5, 1000, 4099])
@pytest.mark.parametrize("stream", [0, 1, 2, 3, 1 << 16 | 1])
def test_rows_match_the_numpy_oracle_and_the_per_index_form(n, stream):
    seeds, positions = _seeds_and_positions(16)
    rows = row_uniforms(seeds, positions, stream, n)  # CPU tensors: the compiled path
    assert torch.equal(rows, _row_uniforms_numpy(seeds, positions, stream, n))
    assert torch.equal(rows, philox_uniform(seeds[:, None], positions[:, None], stream, torch.arange(n)[None, :]))
    assert bool(((rows > 0) & (rows < 1)).all())
    assert torch.equal(row_exponentials(seeds, positions, stream, n), -torch.log(rows))


@pytest.mark.parametrize("rows,n", [(1, 1), (1, 37), (3, 32), (5, 33), (2, 1000), (40, 7)])
def test_chunked_rows_are_the_same_numbers(cpu_path, small_chunks, rows, n):
    seeds, positions = _seeds_and_positions(rows)
    expected = _row_uniforms_numpy(seeds, positions, 2, n)
    assert torch.equal(row_uniforms(seeds, positions, 2, n), expected)
    assert torch.equal(row_exponentials(seeds, positions, 2, n), -torch.log(expected))


def test_zero_rows_and_zero_columns(cpu_path):
    empty = torch.zeros(0, dtype=torch.int64)
    assert row_uniforms(empty, empty, 0, 7).shape == (0, 7)
    assert row_exponentials(empty, empty, 0, 7).shape == (0, 7)
    assert philox_uniform(empty[:, None], empty[:, None], 0, torch.arange(7)[None, :]).shape == (0, 7)
    seeds, positions = _seeds_and_positions(3)
    assert row_uniforms(seeds, positions, 0, 0).shape == (3, 0)
    assert sample_argmax(torch.ones(0, 5), empty, empty, 0).shape == (0,)


def test_different_streams_positions_and_seeds_draw_different_numbers():
    seeds, positions = _seeds_and_positions(4)
    base = row_uniforms(seeds, positions, 0, 64)
    assert not torch.equal(base, row_uniforms(seeds, positions, 1, 64))
    assert not torch.equal(base, row_uniforms(seeds, positions + 1, 0, 64))
    assert not torch.equal(base, row_uniforms(seeds + 1, positions, 0, 64))


def _unfused(probs, seeds, positions, stream):
    return (probs / row_exponentials(seeds, positions, stream, probs.shape[-1])).argmax(dim=-1)


def _probs(rows: int, vocab: int, seed: int = 0) -> torch.Tensor:
    """Peaked rows with exact zeros and exact ties (equal probabilities at several ids)."""
    g = torch.Generator().manual_seed(seed)
    probs = torch.softmax(torch.randn(rows, vocab, generator=g) * 4, dim=-1)
    probs[:, ::3] = 0
    probs[:, 1::5] = probs[:, 1:2].clone()  # ties
    return probs


@pytest.mark.parametrize("rows,vocab", [(1, 1), (4, 2), (3, 5), (8, 111), (2, 1000), (16, 4099)])
def test_sample_argmax_is_the_unfused_argmax(cpu_path, rows, vocab):
    seeds, positions = _seeds_and_positions(rows)
    probs = _probs(rows, vocab)
    for stream in (0, 1):
        drawn = sample_argmax(probs, seeds, positions, stream)
        assert drawn.dtype == torch.int64 and torch.equal(drawn, _unfused(probs, seeds, positions, stream))


@pytest.mark.parametrize("rows,vocab", [(1, 33), (3, 100), (2, 129), (5, 30)])
def test_sample_argmax_in_pieces_keeps_the_first_maximum(cpu_path, small_chunks, rows, vocab):
    seeds, positions = _seeds_and_positions(rows)
    probs = _probs(rows, vocab, seed=1)
    assert torch.equal(sample_argmax(probs, seeds, positions, 3), _unfused(probs, seeds, positions, 3))
    flat = torch.zeros(rows, vocab)  # every score 0: argmax's first index, whichever piece holds it
    assert torch.equal(sample_argmax(flat, seeds, positions, 3), torch.zeros(rows, dtype=torch.int64))
    nan = probs.clone()
    nan[:, vocab // 2] = float("nan")
    nan[:, -1] = float("nan")
    assert torch.equal(sample_argmax(nan, seeds, positions, 3), _unfused(nan, seeds, positions, 3))


def test_sample_argmax_divides_low_precision_probs_in_fp32():
    seeds, positions = _seeds_and_positions(4)
    probs = _probs(4, 300).to(torch.bfloat16)
    assert torch.equal(sample_argmax(probs, seeds, positions, 0), _unfused(probs, seeds, positions, 0))


def test_sample_argmax_rejects_mismatched_shapes():
    seeds, positions = _seeds_and_positions(3)
    with pytest.raises(ValueError, match="probs"):
        sample_argmax(torch.ones(3), seeds, positions, 0)
    with pytest.raises(ValueError, match="seeds"):
        sample_argmax(torch.ones(2, 5), seeds, positions, 0)
    with pytest.raises(ValueError, match="V >= 1"):
        sample_argmax(torch.ones(3, 0), seeds, positions, 0)


def test_one_compiled_graph_for_every_shape():
    from torch._dynamo.utils import counters

    seeds, positions = _seeds_and_positions(9)
    assert philox.warm_up_cpu_noise(wait=True)  # compiled (or loaded) once in this process
    row_uniforms(seeds, positions, 0, 64)
    graphs = counters["stats"]["unique_graphs"]
    for rows, n, stream in [(1, 1, 0), (1, 5, 3), (2, 4099, 1), (9, 4, 2), (9, 64, 1 << 16 | 4)]:
        row_uniforms(seeds[:rows], positions[:rows], stream, n)
        sample_argmax(_probs(rows, n), seeds[:rows], positions[:rows], stream)
        alone = seeds[:rows].clone(), positions[:rows].clone()  # no view of a larger batch
        row_uniforms(*alone, stream, n)
        sample_argmax(_probs(rows, n), *alone, stream)
    assert counters["stats"]["unique_graphs"] == graphs
    assert philox._cpu_compiled is not False


def _fresh_compile_state(monkeypatch, compile_fn) -> None:
    """A process that has not started compiling the CPU noise yet, compiling with ``compile_fn`` after 1 call."""
    monkeypatch.setattr(philox, "_cpu_compiled", None)
    monkeypatch.setattr(philox, "_cpu_compile_thread", None)
    monkeypatch.setattr(philox, "_cpu_eager_calls", 0)
    monkeypatch.setattr(philox, "COMPILE_AFTER_CALLS", 1)
    monkeypatch.setattr(philox.torch, "compile", compile_fn)


def test_samples_do_not_wait_for_the_compiler_and_match_it(monkeypatch):
    """Before the background compile is ready, noise is drawn eagerly - the same numbers the compiled path gives."""
    release = threading.Event()
    real_compile = philox.torch.compile

    def slow_compile(fn, **kwargs):
        release.wait(timeout=60)  # the compiler "takes" until the test has drawn its eager numbers
        return real_compile(fn, **kwargs)

    _fresh_compile_state(monkeypatch, slow_compile)
    seeds, positions = _seeds_and_positions(4)
    probs = _probs(4, 333)
    eager = row_uniforms(seeds, positions, 2, 333), sample_argmax(probs, seeds, positions, 2)
    assert philox._cpu_compiled is None and philox._cpu_compile_thread.is_alive()  # drawn while compiling
    release.set()
    assert philox.warm_up_cpu_noise(wait=True)
    compiled = row_uniforms(seeds, positions, 2, 333), sample_argmax(probs, seeds, positions, 2)
    assert torch.equal(eager[0], compiled[0]) and torch.equal(eager[1], compiled[1])
    assert torch.equal(eager[0], _row_uniforms_numpy(seeds, positions, 2, 333))


def test_short_runs_never_start_the_compiler(monkeypatch):
    """Fewer than COMPILE_AFTER_CALLS eager noise calls start no compile thread (a one-shot run never waits for a
    compile at exit); the call that reaches it does."""
    started = []
    monkeypatch.setattr(philox, "_cpu_compiled", None)
    monkeypatch.setattr(philox, "_cpu_compile_thread", None)
    monkeypatch.setattr(philox, "_cpu_eager_calls", 0)
    monkeypatch.setattr(philox, "COMPILE_AFTER_CALLS", 3)
    monkeypatch.setattr(philox, "_compile_cpu_noise", lambda: started.append(True))
    seeds, positions = _seeds_and_positions(2)
    for _ in range(2):
        row_uniforms(seeds, positions, 0, 16)
    assert philox._cpu_compile_thread is None and not started
    row_uniforms(seeds, positions, 0, 16)
    philox._cpu_compile_thread.join()
    assert started == [True] and not philox._cpu_compile_thread.daemon


def test_threads_draw_the_same_numbers():
    """The serve engine samples in its own thread: concurrent callers share the compiled path (behind a lock)."""
    seeds, positions = _seeds_and_positions(5)
    probs = _probs(5, 1001)
    expected = (row_uniforms(seeds, positions, 1, 1001), sample_argmax(probs, seeds, positions, 1))
    results = []

    def draw():
        for _ in range(3):
            results.append((row_uniforms(seeds, positions, 1, 1001), sample_argmax(probs, seeds, positions, 1)))

    threads = [threading.Thread(target=draw) for _ in range(3)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(results) == 9
    assert all(torch.equal(u, expected[0]) and torch.equal(t, expected[1]) for u, t in results)


def test_a_failing_compiler_falls_back_to_eager_with_one_warning(monkeypatch):
    def broken_compile(fn, **kwargs):
        def call(*args):
            raise RuntimeError("no C++ compiler")
        return call

    _fresh_compile_state(monkeypatch, broken_compile)
    seeds, positions = _seeds_and_positions(5)
    with pytest.warns(RuntimeWarning, match="no C\\+\\+ compiler"):
        got = row_uniforms(seeds, positions, 1, 77)  # eager while the compile thread runs (and fails)
        assert philox.warm_up_cpu_noise(wait=True) is False
    assert philox._cpu_compiled is False
    assert torch.equal(got, _row_uniforms_numpy(seeds, positions, 1, 77))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # warned once: the eager path is silent from then on
        assert torch.equal(row_uniforms(seeds, positions, 1, 77), got)


@triton.jit
def _uniforms_kernel(seed_ptr, position_ptr, out_ptr, n, stream: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    index = tl.arange(0, BLOCK)
    u = philox_uniform_tl(tl.load(seed_ptr + row), tl.load(position_ptr + row), stream, index)
    tl.store(out_ptr + row * n + index, u, mask=index < n)


def test_triton_twin_is_bit_identical():
    seeds, positions = _seeds_and_positions(6)
    out = torch.empty(6, 37)
    _uniforms_kernel[(6,)](seeds, positions, out, 37, stream=3, BLOCK=64)
    assert torch.equal(out, row_uniforms(seeds, positions, 3, 37))
    assert torch.equal(out, _row_uniforms_numpy(seeds, positions, 3, 37))
