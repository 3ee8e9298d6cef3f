"""Inverse-CDF sampling (specdec/kernels/inverse_cdf.py): one Philox uniform per row, the first token whose
cumulative weight exceeds it.

1. Exactness against a float64 oracle written out independently (the flat cumulative sum, no chunks): the same
   token, except where the oracle's threshold lies within fp32 rounding (1e-6 of the total) of the boundary
   between the two tokens - the two-level search rescales inside a chunk by ``S_c / L_last``.
2. The robustness rules: never a zero-weight token (also with the largest and smallest uniforms, a threshold
   rounding onto the total, a single nonzero entry, zeros between and after the support), token 0 for an all-zero
   row, an in-range token for NaN / inf rows, any dtype and shape.
3. The contract: a row's token depends on (seed, position, stream) and its weights only - not on its batch row
   or the other rows.
4. Statistics: 200,000 draws through ``sample_from_probs`` (one seed, positions 0..N-1) from three
   distributions over V = 600 (three chunks, the last one partial) against the exact probabilities, Pearson's
   chi-square with the pooling and Bonferroni bound of test_spec_sample_statistics.py (significance 1e-6); two
   planted mutants - a uniform scaled by 0.99 (the top 1% of the CDF never drawn) and chunk masses that miss
   their second half - must fail the same bound.
"""

from __future__ import annotations

import math

import pytest
import torch
from stats_helpers import chi2_isf
from test_spec_sample_statistics import chi_square

from specdec.kernels import inverse_cdf as icdf
from specdec.kernels.inverse_cdf import CDF_CHUNK, chunk_sums, inverse_cdf
from specdec.kernels.inverse_cdf import sample_inverse_cdf_reference as sample_inverse_cdf
from specdec.kernels.philox import STREAM_DRAFT, STREAM_SAMPLE, draw_uniforms
from specdec.sampling.sampler import sample_from_probs

U_MIN, U_MAX = 2.0**-47, 1.0 - 2.0**-47  # the extreme values of a draw's uniform


def oracle(weights: torch.Tensor, uniforms: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(tokens, margin): the first id whose float64 cumulative weight exceeds U * total, per row, and how far the
    threshold lies from that token's interval ends, relative to the total."""
    cdf = weights.double().cumsum(dim=-1)
    total = cdf[:, -1:]
    t = uniforms[:, None] * total
    token = (cdf <= t).sum(dim=-1).clamp(max=weights.shape[1] - 1)
    lo = torch.where(token > 0, cdf.gather(1, (token - 1).clamp(min=0)[:, None]).squeeze(1), 0.0)
    hi = cdf.gather(1, token[:, None]).squeeze(1)
    margin = torch.minimum(t.squeeze(1) - lo, hi - t.squeeze(1)) / total.squeeze(1)
    return token, margin


def peaked(rows: int, vocab: int, seed: int) -> torch.Tensor:
    """Softmax rows (some very peaked), a third of the ids zeroed, as filtered distributions are."""
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(rows, vocab, generator=g) * torch.linspace(0.5, 8, rows)[:, None]
    probs = torch.softmax(logits, dim=-1)
    probs[:, 1::3] = 0
    return probs


@pytest.mark.parametrize("vocab", [1, 2, 7, 255, 256, 257, 600, 1000, 4099])
def test_matches_the_float64_oracle(vocab):
    rows = 300
    weights = peaked(rows, vocab, seed=vocab)
    u = draw_uniforms(torch.arange(rows), torch.arange(rows) * 11, STREAM_SAMPLE)
    got = inverse_cdf(weights, u)
    want, margin = oracle(weights, u)
    differ = got != want
    assert bool((margin[differ] < 1e-6).all()), f"tokens differ away from a boundary: rows {differ.nonzero()}"
    assert int(differ.sum()) <= 1
    assert bool((weights.gather(1, got[:, None]) > 0).all()), "a zero-weight token was drawn"


def test_unnormalised_rows_and_other_dtypes():
    weights = peaked(50, 700, seed=1)
    u = draw_uniforms(torch.arange(50), torch.zeros(50, dtype=torch.int64), STREAM_DRAFT)
    base = inverse_cdf(weights, u)
    assert torch.equal(inverse_cdf(weights * 1024.0, u), base)  # a power of two scales every sum exactly
    half = weights.to(torch.bfloat16)
    assert torch.equal(inverse_cdf(half, u), inverse_cdf(half.float(), u))
    strided = torch.zeros(50, 1400)
    strided[:, ::2] = weights
    assert torch.equal(inverse_cdf(strided[:, ::2], u), base)


def test_never_a_zero_weight_token_at_the_extremes():
    """The smallest and largest uniforms, zeros before, between and after the support, and rows whose mass sits
    in one chunk of many (the threshold can round onto the total only there)."""
    vocab = 3 * CDF_CHUNK + 17
    rows = []
    for support in ([0], [vocab - 1], [5, 300], [255, 256], [700, 771], list(range(0, vocab, 97))):
        row = torch.zeros(vocab)
        row[support] = torch.rand(len(support), generator=torch.Generator().manual_seed(len(support))) + 0.1
        rows.append(row)
    tiny = torch.zeros(vocab)
    tiny[[3, 500]] = torch.tensor([1.0, 1e-30])  # a token far below the total's resolution, last in the CDF
    rows.append(tiny)
    weights = torch.stack(rows)
    for u in (U_MIN, 0.5, U_MAX):
        got = inverse_cdf(weights, torch.full((len(rows),), u, dtype=torch.float64))
        assert bool((weights.gather(1, got[:, None]) > 0).all()), (u, got)
    top = inverse_cdf(weights, torch.full((len(rows),), U_MAX, dtype=torch.float64))
    last_nonzero = torch.stack([row.nonzero().max() for row in rows])
    assert torch.equal(top[:-1], last_nonzero[:-1])  # the largest uniform: the last token with weight
    bottom = inverse_cdf(weights, torch.full((len(rows),), U_MIN, dtype=torch.float64))
    assert torch.equal(bottom, torch.stack([row.nonzero().min() for row in rows]))  # the smallest: the first


def test_threshold_rounding_onto_the_total_clamps_to_the_last_token_with_weight():
    """U * total can round up to the total; with the cap removed, the search would fall off the end."""
    weights = torch.tensor([[0.25, 0.75, 0.0, 0.0], [0.0, 0.0, 1.0, 0.0]])
    ones = torch.ones(2, dtype=torch.float64)  # as if U * total had rounded up to the total
    assert inverse_cdf(weights, ones).tolist() == [1, 2]


def test_a_single_nonzero_entry_is_always_drawn():
    vocab = 1000
    weights = torch.zeros(64, vocab)
    where = torch.randint(0, vocab, (64,), generator=torch.Generator().manual_seed(0))
    weights[torch.arange(64), where] = torch.rand(64) + 1e-30
    u = draw_uniforms(torch.arange(64), torch.arange(64), STREAM_SAMPLE)
    assert torch.equal(inverse_cdf(weights, u), where)


def test_all_zero_nan_and_inf_rows():
    weights = torch.rand(4, 300)
    weights[0] = 0  # all zero: token 0 (what argmax(0 / E) gave)
    weights[1, 17] = float("nan")
    weights[2, 299] = float("inf")
    weights[3, :] = 0
    weights[3, 290] = float("nan")
    u = torch.full((4,), 0.5, dtype=torch.float64)
    assert inverse_cdf(weights, u).tolist() == [0, 0, 0, 0]


def test_shapes():
    empty = torch.zeros(0, dtype=torch.int64)
    assert inverse_cdf(torch.zeros(0, 5), torch.zeros(0, dtype=torch.float64)).shape == (0,)
    assert sample_inverse_cdf(torch.zeros(0, 5), empty, empty, 0).shape == (0,)
    assert draw_uniforms(empty, empty, 0).shape == (0,)
    with pytest.raises(ValueError, match="weights"):
        inverse_cdf(torch.ones(3), torch.zeros(3, dtype=torch.float64))
    with pytest.raises(ValueError, match="V >= 1"):
        inverse_cdf(torch.ones(3, 0), torch.zeros(3, dtype=torch.float64))
    with pytest.raises(ValueError, match="seeds"):
        sample_inverse_cdf(torch.ones(2, 5), torch.zeros(3, dtype=torch.int64), torch.zeros(3, dtype=torch.int64), 0)


def test_a_rows_token_does_not_depend_on_its_batch():
    """Keyed by (seed, position, stream) only: alone, in a shuffled batch, or beside other rows, the same token."""
    weights = peaked(40, 1500, seed=3)
    seeds = torch.randint(0, 2**62, (40,), generator=torch.Generator().manual_seed(1))
    positions = torch.randint(0, 10**6, (40,), generator=torch.Generator().manual_seed(2))
    batch = sample_inverse_cdf(weights, seeds, positions, STREAM_SAMPLE)
    perm = torch.randperm(40, generator=torch.Generator().manual_seed(3))
    assert torch.equal(sample_inverse_cdf(weights[perm], seeds[perm], positions[perm], STREAM_SAMPLE), batch[perm])
    for r in (0, 17, 39):
        alone = sample_inverse_cdf(weights[r : r + 1].clone(), seeds[r : r + 1], positions[r : r + 1], STREAM_SAMPLE)
        assert alone.item() == batch[r].item()
    assert not torch.equal(sample_inverse_cdf(weights, seeds, positions, STREAM_DRAFT), batch)  # another stream


def test_draw_uniforms_are_two_words_of_one_philox_block():
    """U = u0 + (u1 - 0.5) 2**-23 with u0, u1 the uniforms of indices 0 and 1: 46 bits, in (0, 1)."""
    from specdec.kernels.philox import philox_uniform

    seeds = torch.tensor([0, -1, 2**63 - 1, 12345])
    positions = torch.tensor([0, 7, 2**40, 3])
    u = draw_uniforms(seeds, positions, 3)
    words = philox_uniform(seeds[:, None], positions[:, None], 3, torch.arange(2)[None, :]).double()
    assert torch.equal(u, words[:, 0] + (words[:, 1] - 0.5) * 2.0**-23)
    m = (u * 2.0**47 - 1) / 2  # u = (2m + 1) 2**-47 with m an integer in [0, 2**46)
    assert torch.equal(m, m.round()) and bool(((m >= 0) & (m < 2.0**46)).all())


def canonical_sum(chunk: list[float]) -> float:
    """The contract's halving order written out with numpy float32 scalars (no torch)."""
    import numpy as np

    x = [np.float32(v) for v in chunk]
    while len(x) > 1:
        h = len(x) // 2
        x = [np.float32(x[i] + x[i + h]) for i in range(h)]
    return float(x[0])


def test_chunk_sums_follow_the_canonical_order():
    weights = peaked(3, 2 * CDF_CHUNK + 40, seed=5) * torch.logspace(-20, 0, 2 * CDF_CHUNK + 40)
    padded = torch.zeros(3, 3 * CDF_CHUNK)
    padded[:, : weights.shape[1]] = weights
    expected = [[canonical_sum(padded[r, c * CDF_CHUNK : (c + 1) * CDF_CHUNK].tolist()) for c in range(3)]
                for r in range(3)]  # fmt: skip
    assert chunk_sums(weights).tolist() == expected
    with_rows_in_blocks = chunk_sums(peaked(70, 5000, seed=6))
    assert torch.equal(with_rows_in_blocks[13:14], chunk_sums(peaked(70, 5000, seed=6)[13:14].clone()))


# --- statistics ------------------------------------------------------------------------------------------------
DRAWS = 200_000
STAT_VOCAB = 2 * CDF_CHUNK + 88  # three chunks, the last one partial
ALPHA = 1e-6


def stat_distributions() -> torch.Tensor:
    """Three rows over STAT_VOCAB: a peaked filtered softmax, a flat row with zeros, mass split across chunks."""
    g = torch.Generator().manual_seed(11)
    peaked_row = torch.softmax(2.0 * torch.randn(STAT_VOCAB, generator=g), dim=-1)
    peaked_row[peaked_row < peaked_row.kthvalue(STAT_VOCAB - 60).values] = 0  # top-60 filter, unnormalised
    flat = torch.rand(STAT_VOCAB, generator=g) + 0.5
    flat[::7] = 0
    split = torch.zeros(STAT_VOCAB)
    split[[3, 200, 255, 256, 300, 511, 512, STAT_VOCAB - 1]] = torch.tensor([5.0, 1, 2, 3, 1, 4, 2, 6])
    return torch.stack([peaked_row, flat, split])


def draw_counts(probs: torch.Tensor) -> torch.Tensor:
    """Counts ``[3, V]`` of DRAWS tokens per distribution through ``sample_from_probs`` (positions 0..N-1)."""
    counts = torch.zeros(probs.shape[0], STAT_VOCAB, dtype=torch.int64)
    step = 10_000
    for d, row in enumerate(probs):
        for p0 in range(0, DRAWS, step):
            positions = torch.arange(p0, p0 + step)
            tokens = sample_from_probs(row.expand(step, -1), torch.full((step,), 1000 + d), positions, STREAM_SAMPLE)
            counts[d] += torch.bincount(tokens, minlength=STAT_VOCAB)
    return counts


def worst_over_bound(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """max over the distributions of chi-square / its Bonferroni critical value (> 1: rejected)."""
    worst = 0.0
    for d in range(probs.shape[0]):
        stat, df = chi_square(counts[d], probs[d].double() / probs[d].double().sum())
        if math.isinf(stat):
            return math.inf
        worst = max(worst, stat / chi2_isf(ALPHA / probs.shape[0], df))
    return worst


def test_samples_follow_the_exact_distribution():
    probs = stat_distributions()
    assert worst_over_bound(draw_counts(probs), probs) < 1.0


def _scaled_uniforms(seeds, positions, stream):
    return draw_uniforms(seeds, positions, stream) * 0.99


def _half_chunk_sums(weights):
    rows, vocab = weights.shape
    return chunk_sums(torch.where(torch.arange(vocab) % CDF_CHUNK < CDF_CHUNK // 2, weights, 0.0))


@pytest.mark.parametrize("mutant", ["uniform scaled by 0.99", "chunk masses miss their second half"])
def test_planted_mutants_are_rejected(monkeypatch, mutant):
    if mutant == "uniform scaled by 0.99":
        monkeypatch.setattr(icdf, "draw_uniforms", _scaled_uniforms)
    else:
        monkeypatch.setattr(icdf, "chunk_sums", _half_chunk_sums)
    probs = stat_distributions()
    assert worst_over_bound(draw_counts(probs), probs) > 1.0
