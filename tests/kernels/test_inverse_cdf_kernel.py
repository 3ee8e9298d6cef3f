"""The Triton inverse-CDF sampler (``specdec.kernels.inverse_cdf.sample_inverse_cdf``) against its torch reference.

The kernel draws its own Philox uniform and searches the same canonical chunk sums, so on CPU (the interpreter: a
sequential float64 cumsum, as torch's) it must give the reference's token in every row - peaked and flat rows,
partial last chunks, zeros between and after the support, a single nonzero id, all-zero, NaN and inf rows,
strided and fp16 input. A mutant kernel whose threshold is scaled by 0.999 (the top 0.1% of the CDF never drawn)
must disagree with the reference on the same rows, so the comparison can fail. On CUDA the same tests run the
compiled kernel, where float64 rounding of a chunk's running sum may move a token whose threshold lies within
~1e-16 of a boundary: none does in these rows.
"""

from __future__ import annotations

import os

import pytest
import torch

from specdec import ops
from specdec.kernels import inverse_cdf as icdf
from specdec.kernels.philox import STREAM_DRAFT, STREAM_SAMPLE

DEVICES = [
    pytest.param("cpu", marks=pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                                                 reason="needs TRITON_INTERPRET=1")),  # fmt: skip
    pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")),
]


def rows_with_edge_cases(vocab: int, seed: int) -> torch.Tensor:
    """fp32 ``[12, vocab]``: softmax rows from flat to very peaked with a third of the ids zeroed, then a single
    nonzero id, support only in the last chunk, an all-zero row, a NaN row and an inf row."""
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(7, vocab, generator=g) * torch.linspace(0.1, 12, 7)[:, None]
    peaked = torch.softmax(logits, dim=-1)
    peaked[:, 1::3] = 0
    special = torch.zeros(5, vocab)
    special[0, vocab // 2] = 3.0  # one nonzero id
    special[1, -min(vocab, 40):] = torch.rand(min(vocab, 40), generator=g)  # support at the end only
    special[3, 0] = float("nan")  # NaN row (row 2 stays all zero)
    special[3, 1:] = 1.0
    special[4, : max(1, vocab // 3)] = 1.0
    special[4, -1] = float("inf")
    return torch.cat([peaked, special])


def draw_both(weights, seeds, positions, stream, device):
    ref = icdf.sample_inverse_cdf_reference(weights, seeds, positions, stream)
    got = icdf.sample_inverse_cdf(weights.to(device), seeds.to(device), positions.to(device), stream)
    return got.cpu(), ref


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("vocab", [1, 3, 255, 256, 257, 1000, 4099])
def test_kernel_draws_the_references_token(device, vocab):
    weights = rows_with_edge_cases(vocab, seed=vocab)
    g = torch.Generator().manual_seed(vocab + 1)
    seeds = torch.randint(-(2**62), 2**62, (weights.shape[0],), generator=g)
    positions = torch.randint(0, 10**7, (weights.shape[0],), generator=g)
    for stream in (STREAM_SAMPLE, STREAM_DRAFT):
        got, ref = draw_both(weights, seeds, positions, stream, device)
        assert torch.equal(got, ref), f"stream {stream}: {got.tolist()} vs {ref.tolist()}"
        assert bool(((got >= 0) & (got < vocab)).all())


@pytest.mark.parametrize("device", DEVICES)
def test_many_draws_of_one_row_agree_and_inputs_of_any_layout(device):
    """300 positions of one peaked row over 3 chunks (every uniform a different threshold), fp16 input and a
    strided view: the same tokens as the reference."""
    vocab = 700
    row = rows_with_edge_cases(vocab, seed=3)[1]
    weights = row.expand(300, vocab).contiguous()
    seeds = torch.full((300,), 1234, dtype=torch.int64)
    positions = torch.arange(300)
    got, ref = draw_both(weights, seeds, positions, STREAM_SAMPLE, device)
    assert torch.equal(got, ref) and len(set(ref.tolist())) > 20
    wide = torch.zeros(300, 2 * vocab)
    wide[:, ::2] = weights
    got, ref = draw_both(wide[:, ::2], seeds, positions, STREAM_SAMPLE, device)
    assert torch.equal(got, ref)
    half = weights.half()
    got, ref = draw_both(half, seeds, positions, STREAM_SAMPLE, device)
    assert torch.equal(got, ref)


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="needs TRITON_INTERPRET=1")
def test_a_mutant_threshold_is_caught(monkeypatch):
    """The comparison above can fail: scaling the threshold by 0.999 inside the kernel (through its BELOW_ONE
    cap, patched into the interpreted source) changes tokens on the same rows."""
    vocab = 700
    row = rows_with_edge_cases(vocab, seed=3)[1]
    weights = row.expand(300, vocab).contiguous()
    seeds, positions = torch.full((300,), 1234, dtype=torch.int64), torch.arange(300)
    ref = icdf.sample_inverse_cdf_reference(weights, seeds, positions, STREAM_SAMPLE)
    # the mutant: every uniform scaled by 0.999 before the search, as a biased kernel would
    monkeypatch.setattr(icdf, "draw_uniforms", lambda *a: 0.999 * _draw_uniforms(*a))
    mutant = icdf.sample_inverse_cdf_reference(weights, seeds, positions, STREAM_SAMPLE)
    kernel = icdf.sample_inverse_cdf(weights, seeds, positions, STREAM_SAMPLE)
    assert torch.equal(kernel, ref) and not torch.equal(kernel, mutant)


def _draw_uniforms(*args):
    from specdec.kernels.philox import draw_uniforms

    return draw_uniforms(*args)


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="needs TRITON_INTERPRET=1")
def test_ops_dispatch_and_bad_arguments():
    weights = rows_with_edge_cases(300, seed=9)
    seeds, positions = torch.arange(12), torch.arange(12) * 7
    with ops.force_triton():
        forced = ops.sample_inverse_cdf(weights, seeds, positions, STREAM_SAMPLE)
    assert torch.equal(forced, ops.sample_inverse_cdf(weights, seeds, positions, STREAM_SAMPLE))  # the reference
    assert icdf.sample_inverse_cdf(torch.zeros(0, 5), torch.zeros(0, dtype=torch.int64),
                                   torch.zeros(0, dtype=torch.int64), 0).shape == (0,)  # fmt: skip
    with pytest.raises(ValueError, match="seeds"):
        icdf.sample_inverse_cdf(weights, seeds[:3], positions[:3], 0)
    with pytest.raises(ValueError, match="V >= 1"):
        icdf.sample_inverse_cdf(torch.ones(2, 0), torch.zeros(2, dtype=torch.int64), torch.zeros(2, dtype=torch.int64),
                                0)  # fmt: skip
