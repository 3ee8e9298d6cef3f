"""The randomness contract's Philox4x32-10: published known-answer vectors, and its three twins - torch (the
CUDA host path), numpy (the CPU row path) and Triton (inside the kernels) - bit-identical."""

import numpy as np
import pytest
import torch
import triton
import triton.language as tl

from specdec.kernels import philox
from specdec.kernels.philox import philox4x32, philox_uniform, philox_uniform_tl, row_uniforms

# Random123's kat_vectors for philox4x32_10: (key, counter) -> output
KNOWN_ANSWERS = [
    ((0, 0), (0, 0, 0, 0), (0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8)),
    ((0xFFFFFFFF,) * 2, (0xFFFFFFFF,) * 4, (0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD)),
    ((0xA4093822, 0x299F31D0), (0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344),
     (0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1)),
]


@pytest.mark.parametrize("key,counter,expected", KNOWN_ANSWERS)
def test_known_answers(key, counter, expected):
    as_t = lambda v: torch.tensor(v, dtype=torch.int64)  # noqa: E731
    assert tuple(int(w) for w in philox4x32(tuple(map(as_t, key)), tuple(map(as_t, counter)))) == expected
    as_u = lambda v: np.array([v], dtype=np.uint64)  # noqa: E731
    got = philox._philox4x32_numpy(tuple(map(as_u, key)), tuple(map(as_u, counter)))
    assert tuple(int(w[0]) for w in got) == expected


def _seeds_and_positions(rows: int):
    g = torch.Generator().manual_seed(0)
    seeds = torch.randint(-(2**63), 2**63 - 1, (rows,), dtype=torch.int64, generator=g)
    seeds[:3] = torch.tensor([0, 2**63 - 1, -1])  # the extremes of the key's bits
    positions = torch.randint(0, 2**40, (rows,), dtype=torch.int64, generator=g)
    positions[0] = 0
    return seeds, positions


@pytest.mark.parametrize("n", [1, 3, 4, 5, 1000, 4099])
@pytest.mark.parametrize("stream", [0, 1, 2, 3])
def test_torch_and_numpy_rows_are_bit_identical(n, stream):
    seeds, positions = _seeds_and_positions(16)
    numpy_rows = row_uniforms(seeds, positions, stream, n)  # CPU tensors: the numpy path
    torch_rows = philox_uniform(seeds[:, None], positions[:, None], stream, torch.arange(n)[None, :])
    assert torch.equal(numpy_rows, torch_rows)
    assert bool(((numpy_rows > 0) & (numpy_rows < 1)).all())


def test_zero_rows_and_zero_columns():
    empty = torch.zeros(0, dtype=torch.int64)
    assert row_uniforms(empty, empty, 0, 7).shape == (0, 7)
    assert philox_uniform(empty[:, None], empty[:, None], 0, torch.arange(7)[None, :]).shape == (0, 7)
    seeds, positions = _seeds_and_positions(3)
    assert row_uniforms(seeds, positions, 0, 0).shape == (3, 0)


def test_different_streams_positions_and_seeds_draw_different_numbers():
    seeds, positions = _seeds_and_positions(4)
    base = row_uniforms(seeds, positions, 0, 64)
    assert not torch.equal(base, row_uniforms(seeds, positions, 1, 64))
    assert not torch.equal(base, row_uniforms(seeds, positions + 1, 0, 64))
    assert not torch.equal(base, row_uniforms(seeds + 1, positions, 0, 64))


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
