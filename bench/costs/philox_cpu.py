"""Philox noise on the CPU: the pre-issue-10 numpy path vs eager torch vs the compiled torch path, interleaved.

Per (rows, vocab): ns per element of ``row_exponentials`` (numpy words + eager ``-log``; the same int64 torch code
eager, chunked; compiled by Inductor, chunked) and ms per call of sampling ``argmax(p / E)`` (numpy noise then
divide and argmax, as ``sample_from_probs`` did before issue 10; ``sample_argmax``, fused per chunk, as it did until
the inverse CDF replaced the exponential race; ``sample_inverse_cdf``, one uniform per row, as it does now -
``kernels/inverse_cdf.py``; V-wide noise is now drawn only for the tree drafter's Gumbel-top-c children).
Variants are interleaved and each figure is the median over repetitions, so a noisy neighbour shifts all of them
alike. ``--chunks`` sweeps the compiled path's blocks per call (0: one call for everything). The first call's time
(compiling, or loading Inductor's on-disk cache; set ``TORCHINDUCTOR_CACHE_DIR`` to an empty folder for a cold
compile) is printed.

    python -m bench.costs.philox_cpu [--rows 1 8 64] [--vocab 512 32000 128256] [--reps 5] [--chunks 4096 16384 65536 0]

(The ``--host-overhead numpy`` mode that patched the numpy noise back into ``bench.costs.host_overhead`` is gone: the
sampler and the verification references draw one uniform per row now, so there is no noise left to patch; the
figures it gave were in docs/benchmarks.md at commit ``eb2d8f5``.)
"""

from __future__ import annotations

import argparse
import sys
import time
from functools import partial

import numpy as np
import torch

from bench.common import median, print_table, set_threads, warm_up_sampling
from specdec.kernels import philox
from specdec.kernels.inverse_cdf import sample_inverse_cdf_reference as sample_inverse_cdf


def numpy_row_uniforms(seeds: torch.Tensor, positions: torch.Tensor, stream: int, n: int) -> torch.Tensor:
    """The CPU path before issue 10: Philox4x32-10 over ``[R, ceil(n / 4)]`` blocks in numpy uint64, ``[R, n]``."""
    as_u64 = lambda t: t.long().contiguous().numpy().view(np.uint64)[:, None]  # noqa: E731 - int64 bits
    seed, position = as_u64(seeds), as_u64(positions)  # (R, 1)
    mask, shift = np.uint64(0xFFFFFFFF), np.uint64(32)
    k0, k1 = seed & mask, seed >> shift
    blocks = np.arange((n + 3) // 4, dtype=np.uint64)[None, :]
    c0 = np.broadcast_to(blocks, (seed.shape[0], blocks.shape[1]))
    c1, c2, c3 = position & mask, position >> shift, np.full_like(c0, stream)
    round_a, round_b, key_a, key_b = (np.uint64(v) for v in (0xD2511F53, 0xCD9E8D57, 0x9E3779B9, 0xBB67AE85))
    for _ in range(10):
        prod_b, prod_a = c2 * round_b, c0 * round_a
        c0, c1, c2, c3 = (prod_b >> shift) ^ c1 ^ k0, prod_b & mask, (prod_a >> shift) ^ c3 ^ k1, prod_a & mask
        k0, k1 = (k0 + key_a) & mask, (k1 + key_b) & mask
    bits = np.stack(np.broadcast_arrays(c0, c1, c2, c3), axis=-1).reshape(seed.shape[0], -1)[:, :n]  # (R, n)
    u = ((bits >> np.uint64(9)) * np.uint64(2) + np.uint64(1)).astype(np.float32) * np.float32(2.0**-24)
    return torch.from_numpy(u)


def numpy_row_exponentials(seeds, positions, stream, n):
    return -torch.log(numpy_row_uniforms(seeds, positions, stream, n))


def numpy_sample(probs, seeds, positions, stream):
    return (probs / numpy_row_exponentials(seeds, positions, stream, probs.shape[-1])).argmax(dim=-1)


def _with(compiled: bool, chunk: int):
    """A call of ``fn`` with the CPU path compiled or eager and ``chunk`` blocks per call (0: no chunking)."""
    def run(fn, *args):
        saved = philox._cpu_compiled, philox._CPU_CHUNK_BLOCKS
        philox._CPU_CHUNK_BLOCKS = chunk or 1 << 40
        if not compiled:
            philox._cpu_compiled = False
        try:
            return fn(*args)
        finally:
            philox._cpu_compiled, philox._CPU_CHUNK_BLOCKS = saved
    return run


def microbenchmark(rows_list: list[int], vocabs: list[int], reps: int, chunks: list[int]) -> None:
    g = torch.Generator().manual_seed(0)
    start = time.perf_counter()
    philox.row_exponentials(torch.arange(3), torch.arange(3), 0, 100)
    print(f"first compiled call (compile or cache load): {time.perf_counter() - start:.1f} s", flush=True)
    noise = {"numpy": numpy_row_exponentials, "torch eager": partial(_with(False, 16384), philox.row_exponentials)}
    noise |= {f"compiled {c or 'one call'}": partial(_with(True, c), philox.row_exponentials) for c in chunks}
    table = []
    for rows in rows_list:
        seeds = torch.randint(-(2**63), 2**63 - 1, (rows,), dtype=torch.int64, generator=g)
        positions = torch.randint(0, 2**40, (rows,), dtype=torch.int64, generator=g)
        for vocab in vocabs:
            probs = torch.softmax(torch.randn(rows, vocab, generator=g) * 3, dim=-1)
            sample = {"numpy unfused": numpy_sample, "sample_argmax": philox.sample_argmax,
                      "sample_inverse_cdf": sample_inverse_cdf}
            times = {name: [] for name in [*noise, *sample]}
            reference = numpy_row_exponentials(seeds, positions, 1, vocab)
            for name, fn in noise.items():
                assert torch.equal(fn(seeds, positions, 1, vocab), reference), name
            drawn = philox.sample_argmax(probs, seeds, positions, 1)
            assert torch.equal(drawn, numpy_sample(probs, seeds, positions, 1))
            for _ in range(reps):  # interleaved
                for name, fn in noise.items():
                    t0 = time.perf_counter()
                    fn(seeds, positions, 1, vocab)
                    times[name].append(time.perf_counter() - t0)
                for name, fn in sample.items():
                    t0 = time.perf_counter()
                    fn(probs, seeds, positions, 1)
                    times[name].append(time.perf_counter() - t0)
            elements = rows * vocab
            table.append([rows, vocab, *(f"{1e9 * median(times[n]) / elements:.2f}" for n in noise),
                          *(f"{1e3 * median(times[n]):.3f}" for n in sample)])
            print(table[-1], flush=True)
    print_table(table, ["rows", "vocab", *(f"{n} ns/el" for n in noise), "sample numpy ms", "sample_argmax ms",
                        "inverse_cdf ms"])


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 8, 64])
    parser.add_argument("--vocab", type=int, nargs="+", default=[512, 32000, 128256])
    parser.add_argument("--reps", type=int, default=5, help="interleaved repetitions (the median is reported)")
    parser.add_argument("--chunks", type=int, nargs="+", default=[16384], help="compiled blocks per call (0: all)")
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    args = parser.parse_args(argv)
    set_threads(args.threads)
    warm_up_sampling()
    microbenchmark(args.rows, args.vocab, args.reps, args.chunks)
    return 0


if __name__ == "__main__":
    sys.exit(main())
