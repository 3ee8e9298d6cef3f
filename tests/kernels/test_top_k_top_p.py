"""Top-k -> top-p -> min-p filtering: kernel == reference kept sets, and both against independent oracles.

Three kinds of check:
- exact hand-written rows with the expected output (ties at k, top-p strictly below / at / just above a
  boundary, the order top-k -> renormalise -> top-p, min-p after renormalisation, no-ops, out-of-range values);
- a pairwise definitional oracle (no sorting: "fewer than k values strictly larger", "mass strictly larger
  < p * kept mass") in fp64, exact on dyadic rows (multiples of 2**-12), so boundary cases can be planted;
- kernel vs reference on random rows of irregular vocab sizes with mixed per-row settings: identical kept sets,
  values within fp32 rounding, rows summing to 1.
CPU tensors run the kernel in the Triton interpreter; with CUDA the compiled kernel runs the same tests.
"""

import math
import os

import pytest
import torch

from specdec.kernels.top_k_top_p import (
    MAX_VOCAB,
    top_k_top_p_config,
    top_k_top_p_min_p,
    top_k_top_p_min_p_reference,
)

IMPLS = [
    "reference",
    pytest.param(
        "cpu", marks=pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="needs TRITON_INTERPRET=1")
    ),
    pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")),
]
KERNEL_DEVICES = IMPLS[1:]
# Kernel vs reference: one renormalisation vs three, and different summation orders.
VALUE_TOL = {"rtol": 1e-5, "atol": 1e-8}


def _filter(impl: str, probs, top_k, top_p, min_p) -> torch.Tensor:
    """Run the reference or the kernel on device ``impl``; inputs are lists or CPU tensors, output on CPU."""
    probs = torch.as_tensor(probs, dtype=torch.float32)
    if probs.ndim == 1:
        probs = probs[None]
    args = (
        torch.as_tensor(top_k, dtype=torch.int64).reshape(-1),
        torch.as_tensor(top_p, dtype=torch.float32).reshape(-1),
        torch.as_tensor(min_p, dtype=torch.float32).reshape(-1),
    )
    if impl == "reference":
        return top_k_top_p_min_p_reference(probs, *args)
    return top_k_top_p_min_p(probs.to(impl), *(a.to(impl) for a in args)).cpu()


def _oracle_keep(p: torch.Tensor, k: int, top_p: float, min_p: float) -> torch.Tensor:
    """Kept set of one row straight from the definitions, pairwise in fp64 (exact for dyadic rows)."""
    p = p.double()
    vocab = p.numel()
    larger = p[None, :] > p[:, None]  # (V, V): [i, j] = p_j > p_i
    keep = larger.sum(dim=1) < (k if 0 < k < vocab else vocab)  # fewer than k strictly larger values
    if top_p < 1:
        kept = torch.where(keep, p, 0.0)
        keep &= (larger.double() * kept[None, :]).sum(dim=1) < top_p * kept.sum()
        keep |= p == p.max()  # the max run survives any top_p (only matters for top_p <= 0)
    # min-p: the contract's threshold is the fp32 product min_p * max (one rounding, as in both implementations).
    min_p_threshold = torch.tensor(min(max(min_p, 0.0), 1.0), dtype=torch.float32) * p.max().float()
    return keep & (p >= min_p_threshold.double())


def _next_up(x: float) -> float:
    return torch.nextafter(torch.tensor(x), torch.tensor(2.0)).item()


def _next_down(x: float) -> float:
    return torch.nextafter(torch.tensor(x), torch.tensor(0.0)).item()


HAND_CASES = [
    # (probs, top_k, top_p, min_p, expected)
    ([0.4, 0.2, 0.2, 0.1, 0.1], 2, 1.0, 0.0, [0.5, 0.25, 0.25, 0, 0]),  # 2nd largest is tied: both kept
    ([0.3, 0.3, 0.2, 0.2], 1, 1.0, 0.0, [0.5, 0.5, 0, 0]),  # k = 1 keeps a tied max run
    ([0.5, 0.25, 0.125, 0.125], 0, 1.0, 0.0, [0.5, 0.25, 0.125, 0.125]),  # all off
    ([0.5, 0.25, 0.125, 0.125], 4, 1.0, 0.0, [0.5, 0.25, 0.125, 0.125]),  # k = V
    ([0.5, 0.25, 0.125, 0.125], 9, 1.0, 0.0, [0.5, 0.25, 0.125, 0.125]),  # k > V
    ([0.5, 0.25, 0.125, 0.125], -3, 1.0, 0.0, [0.5, 0.25, 0.125, 0.125]),  # k < 0 is off
    ([0.5, 0.25, 0.125, 0.125], 3, 1.0, 0.0, [0.5, 0.25, 0.125, 0.125]),  # 3rd largest tied with the 4th
    ([0.5, 0.25, 0.125, 0.125], 0, 0.75, 0.0, [2 / 3, 1 / 3, 0, 0]),  # mass above 0.125s == p: dropped
    ([0.5, 0.25, 0.125, 0.125], 0, _next_up(0.75), 0.0, [0.5, 0.25, 0.125, 0.125]),  # just above: kept
    ([0.5, 0.25, 0.125, 0.125], 0, 0.5, 0.0, [1, 0, 0, 0]),
    ([0.5, 0.25, 0.125, 0.125], 0, _next_up(0.5), 0.0, [2 / 3, 1 / 3, 0, 0]),
    ([0.5, 0.25, 0.125, 0.125], 0, _next_down(0.5), 0.0, [1, 0, 0, 0]),
    ([0.25, 0.25, 0.25, 0.25], 0, 0.3, 0.0, [0.25, 0.25, 0.25, 0.25]),  # one tie run: nothing strictly above
    ([0.5, 0.125, 0.125, 0.125, 0.125], 0, 0.55, 0.0, [0.5, 0.125, 0.125, 0.125, 0.125]),  # run kept whole
    ([0.4, 0.4, 0.2], 0, 0.0, 0.0, [0.5, 0.5, 0]),  # top_p <= 0 still keeps the max run
    ([0.4, 0.4, 0.2], 0, 1.5, 0.0, [0.4, 0.4, 0.2]),  # top_p > 1 is off
    # top-p sees the top-k-renormalised row [.375, .375, .25]: mass above 0.25 is 0.75.
    ([0.3, 0.3, 0.2, 0.1, 0.1], 3, 0.7, 0.0, [0.5, 0.5, 0, 0, 0]),  # on the raw row 0.6 < 0.7 would keep 0.2
    ([0.3, 0.3, 0.2, 0.1, 0.1], 3, 0.8, 0.0, [0.375, 0.375, 0.25, 0, 0]),
    ([0.5, 0.25, 0.125, 0.125], 0, 1.0, 0.25, [0.5, 0.25, 0.125, 0.125]),  # min-p threshold 0.125, inclusive
    ([0.5, 0.25, 0.125, 0.125], 0, 1.0, 0.5, [2 / 3, 1 / 3, 0, 0]),
    ([0.5, 0.25, 0.125, 0.0625, 0.0625], 0, 0.8, 0.25, [4 / 7, 2 / 7, 1 / 7, 0, 0]),  # top-p, then min-p
    ([0.5, 0.25, 0.125, 0.0625, 0.0625], 0, 0.8, 0.5, [2 / 3, 1 / 3, 0, 0, 0]),
    ([0.4, 0.4, 0.2], 0, 1.0, 1.0, [0.5, 0.5, 0]),  # min_p = 1 keeps the max run
    ([0.4, 0.4, 0.2], 0, 1.0, 7.0, [0.5, 0.5, 0]),  # min_p > 1 is clamped to 1
    ([0.4, 0.4, 0.2], 0, 1.0, -1.0, [0.4, 0.4, 0.2]),  # min_p < 0 is off
    ([0.4, 0.4, 0.2], 0, float("nan"), float("nan"), [0.4, 0.4, 0.2]),  # NaN top_p / min_p are off
    ([0.75, 0.25, 0.0, 0.0], 3, 1.0, 0.0, [0.75, 0.25, 0, 0]),  # zeros "kept" by a tie at 0 stay 0
    ([0.6, 0.3, 0.1], 2, 0.9, 0.5, [2 / 3, 1 / 3, 0]),  # k=2 -> [2/3, 1/3]; top-p keeps both; min-p 1/3 ok
]


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("case", range(len(HAND_CASES)))
def test_hand_written_cases(case: int, impl: str) -> None:
    probs, top_k, top_p, min_p, expected = HAND_CASES[case]
    out = _filter(impl, probs, top_k, top_p, min_p)
    torch.testing.assert_close(out, torch.tensor([expected], dtype=torch.float32), rtol=1e-6, atol=1e-7)


def _dyadic_rows(rows: int, vocab: int, seed: int) -> torch.Tensor:
    """fp32 rows of multiples of 2**-6 or 2**-12 summing to exactly 1, skewed, with many ties and some zeros."""
    g = torch.Generator().manual_seed(seed)
    num_draws = 64 if vocab < 100 else 4096
    weights = torch.softmax(torch.randn(rows, vocab, generator=g) * 2, dim=-1)
    draws = torch.multinomial(weights, num_draws, replacement=True, generator=g)  # (rows, num_draws)
    counts = torch.zeros(rows, vocab).scatter_add_(1, draws, torch.ones(rows, num_draws))
    return counts / num_draws


def _boundary_settings(row: torch.Tensor, case: int, g: torch.Generator) -> tuple[int, float, float]:
    """(k, p, min_p) planted on a tie run of ``row`` (exact: dyadic values, sum 1, dyadic min_p)."""
    values, counts = torch.unique(row, sorted=True, return_counts=True)
    values, counts = values.flip(0), counts.flip(0)  # descending runs
    runs_before = torch.cumsum(counts, 0) - counts  # tokens strictly above each run
    mass_above = torch.cumsum(values * counts, 0) - values * counts  # exact: multiples of 2**-12
    tied = (counts >= 2).nonzero().flatten()
    j = int(tied[torch.randint(len(tied), (1,), generator=g)]) if len(tied) else 0
    interior_k = int(runs_before[j]) + int(counts[j] + 1) // 2  # inside the run (its first member if length 1)
    p_at_run = float(mass_above[j])
    min_p = [0.0, 0.0625, 0.25, 0.5, 0.75][case % 5]
    return [
        (interior_k, 1.0, 0.0),
        (0, p_at_run, 0.0) if p_at_run > 0 else (0, 1.0, 0.0),  # run j dropped (mass above == p)
        (0, _next_up(p_at_run), 0.0),  # run j kept
        (0, _next_down(p_at_run), 0.0) if p_at_run > 0 else (0, 0.5, 0.0),
        (interior_k, 1.0, min_p),
        (interior_k, float(torch.rand((), generator=g)), min_p),
        (0, 1.0, min_p),
    ][case % 7]


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("vocab", [7, 48, 1000])
def test_dyadic_rows_match_oracle(vocab: int, impl: str) -> None:
    # Exact arithmetic everywhere, so the implementations must reproduce the definitions exactly, including
    # k inside a tie run and p exactly at / one ulp around the mass above a run.
    rows = 7 if vocab == 1000 else 14  # every planted setting once or twice
    probs = _dyadic_rows(rows, vocab, seed=vocab)
    g = torch.Generator().manual_seed(vocab + 1)
    settings = [_boundary_settings(probs[r], r, g) for r in range(rows)]
    top_k, top_p, min_p = (list(col) for col in zip(*settings))
    out = _filter(impl, probs, top_k, top_p, min_p)
    for r in range(rows):
        keep = _oracle_keep(probs[r], top_k[r], top_p[r], min_p[r])
        assert torch.equal(out[r] > 0, keep & (probs[r] > 0)), f"row {r}: k={top_k[r]} p={top_p[r]} min_p={min_p[r]}"
        expected = torch.where(keep, probs[r], 0.0)
        torch.testing.assert_close(out[r], expected / expected.sum(), **VALUE_TOL)


def _random_settings(rows: int, vocab: int, g: torch.Generator) -> tuple[torch.Tensor, ...]:
    def pick(options: list) -> torch.Tensor:
        return torch.tensor(options)[torch.randint(len(options), (rows,), generator=g)]

    top_k = pick([0, 1, 2, 10, vocab // 3, vocab - 1, vocab, vocab + 5, -1])
    top_p = pick([1.0, 0.99, 0.9, 0.5, 0.3, 1e-6])
    min_p = pick([0.0, 0.0, 0.01, 0.1, 0.5])
    top_k[0], top_p[0], min_p[0] = 0, 1.0, 0.0  # an all-off row in every batch
    return top_k, top_p.float(), min_p.float()


@pytest.mark.parametrize("device", KERNEL_DEVICES)
@pytest.mark.parametrize("rows,vocab", [(9, 111), (7, 1000), (5, 4099)])
def test_kernel_matches_reference(rows: int, vocab: int, device: str) -> None:
    g = torch.Generator().manual_seed(vocab)
    scale = torch.linspace(0.5, 6.0, rows)[:, None]  # flat to peaked rows
    wide = torch.softmax(torch.randn(rows, vocab + 13, generator=g) * scale, dim=-1)
    probs = wide[:, :vocab] / wide[:, :vocab].sum(-1, keepdim=True)
    if rows > 5:  # a row quantised into long tie runs and one with zeros
        probs[1] = torch.round(probs[1] * 64) / 64
        probs[2, ::3] = 0.0
    top_k, top_p, min_p = _random_settings(rows, vocab, g)
    if vocab == 111:
        top_k = top_k.int()  # int32 is accepted too
    wide_probs = torch.zeros(rows, vocab + 5)
    wide_probs[:, :vocab] = probs
    # Row stride vocab + 5: the launcher must honour a non-contiguous row view.
    out = top_k_top_p_min_p(*(t.to(device) for t in (wide_probs[:, :vocab], top_k, top_p, min_p))).cpu()
    ref = top_k_top_p_min_p_reference(probs, top_k, top_p, min_p)
    settings = f"k={top_k.tolist()} p={top_p.tolist()} min_p={min_p.tolist()}"
    assert torch.equal(out > 0, ref > 0), settings
    torch.testing.assert_close(out, ref, **VALUE_TOL)
    torch.testing.assert_close(out.sum(-1), torch.ones(rows), rtol=0, atol=1e-5)
    for r in range(rows):  # and the reference against the definitions (no boundary is hit by random rows)
        keep = _oracle_keep(probs[r], int(top_k[r]), float(top_p[r]), float(min_p[r]))
        assert torch.equal(ref[r] > 0, keep & (probs[r] > 0)), f"row {r}: {settings}"
    assert torch.equal(out[0] > 0, probs[0] > 0)  # the all-off row keeps everything


@pytest.mark.parametrize("impl", IMPLS)
def test_all_off_is_renormalisation(impl: str) -> None:
    probs = torch.tensor([[0.2, 0.3, 0.1, 0.0, 0.6]])  # sums to 1.2
    out = _filter(impl, probs, 0, 1.0, 0.0)
    torch.testing.assert_close(out, probs / 1.2, rtol=1e-6, atol=1e-8)


def test_config_and_validation() -> None:
    assert top_k_top_p_config(111).block == 128
    assert top_k_top_p_config(151936) == (2048, 8)
    with pytest.raises(ValueError, match="vocab"):
        top_k_top_p_config(MAX_VOCAB + 1)
    # The fixed-point masses cannot overflow int64 at the largest vocab.
    assert MAX_VOCAB * 2.0**42 <= 2.0**63 - 1 and math.log2(MAX_VOCAB) == 20
    probs, k, p, mp = torch.full((2, 4), 0.25), torch.zeros(2, dtype=torch.int64), torch.ones(2), torch.zeros(2)
    with pytest.raises(ValueError, match="probs"):
        top_k_top_p_min_p(probs.half(), k, p, mp)
    with pytest.raises(ValueError, match="top_k"):
        top_k_top_p_min_p(probs, k.float(), p, mp)
    with pytest.raises(ValueError, match="top_p"):
        top_k_top_p_min_p(probs, k, p.double(), mp)
    with pytest.raises(ValueError, match="min_p"):
        top_k_top_p_min_p(probs, k, p, torch.zeros(3))
    with pytest.raises(ValueError, match="column stride"):
        top_k_top_p_min_p(torch.full((4, 2), 0.5).t(), k, p, mp)
    assert top_k_top_p_min_p(torch.zeros(0, 4), k[:0], p[:0], mp[:0]).shape == (0, 4)


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="needs TRITON_INTERPRET=1")
def test_ops_dispatch_reaches_the_kernel() -> None:
    from specdec import ops

    probs = torch.tensor([[0.5, 0.25, 0.125, 0.125]])
    args = (probs, torch.tensor([2]), torch.tensor([1.0]), torch.tensor([0.0]))
    with ops.force_triton():
        forced = ops.top_k_top_p_min_p(*args)
    torch.testing.assert_close(forced, torch.tensor([[2 / 3, 1 / 3, 0.0, 0.0]]))
    torch.testing.assert_close(ops.top_k_top_p_min_p(*args), forced)  # CPU tensors -> reference


def _radix_stress_rows(rows: int, vocab: int, g: torch.Generator) -> torch.Tensor:
    """Rows that make every 4-bit digit of the radix select matter: neighbouring fp32 values (keys differing in the
    last bits only), long tie runs, zeros and -0.0, a single spike, a uniform row, and values spanning exponents."""
    out = torch.softmax(torch.randn(rows, vocab, generator=g) * torch.linspace(0.3, 8.0, rows)[:, None], dim=-1)
    for r in range(rows):
        kind = r % 6
        if kind == 1:  # clusters of adjacent floats: ulp steps above a few base values
            base = torch.tensor([1e-3, 2e-4, 3e-5])[torch.randint(3, (vocab,), generator=g)]
            ulps = torch.randint(0, 40, (vocab,), generator=g, dtype=torch.int32)
            out[r] = (base.view(torch.int32) + ulps).view(torch.float32)
        elif kind == 2:  # quantised into tie runs, a third zeros, some -0.0
            out[r] = torch.round(out[r] * 32) / 32
            out[r, ::3] = 0.0
            out[r, 1::7] = -0.0
        elif kind == 3:  # one spike over a flat floor
            out[r] = 1.0
            out[r, int(torch.randint(vocab, (1,), generator=g))] = float(vocab)
        elif kind == 4:  # uniform
            out[r] = 1.0
        elif kind == 5:  # very wide dynamic range, with exact duplicates of random entries
            out[r] = torch.exp(torch.randn(vocab, generator=g) * 12)
            dup = torch.randint(vocab, (vocab // 4,), generator=g)
            out[r, dup] = out[r, dup.flip(0)]
        out[r] = out[r] / out[r].sum()
    return out


@pytest.mark.parametrize("device", KERNEL_DEVICES)
@pytest.mark.parametrize("rows,vocab", [(24, 111), (18, 1000), (12, 4099)])
def test_radix_select_matches_reference(rows: int, vocab: int, device: str) -> None:
    # The kernel's radix select (8 passes of 4 bits per filter) vs the sort-based reference: identical kept sets on
    # rows built to exercise every digit, with k at / past the ends, p = 1, p just below 1, tiny, zero and negative.
    g = torch.Generator().manual_seed(1000 + vocab)
    probs = _radix_stress_rows(rows, vocab, g)

    def pick(options: list, dtype: torch.dtype) -> torch.Tensor:
        return torch.tensor(options, dtype=dtype)[torch.randint(len(options), (rows,), generator=g)]

    top_k = pick([0, 1, 2, 3, 17, vocab // 2, vocab - 1, vocab, vocab + 1], torch.int64)
    top_p = pick([1.0, _next_down(1.0), 0.95, 0.7, 0.2, 1e-6, 1e-30, 0.0, -0.5, 1.0], torch.float32)
    min_p = pick([0.0, 0.0, 0.0, 0.02, 0.3, 1.0], torch.float32)
    out = top_k_top_p_min_p(*(t.to(device) for t in (probs, top_k, top_p, min_p))).cpu()
    ref = top_k_top_p_min_p_reference(probs, top_k, top_p, min_p)
    for r in range(rows):
        where = f"row {r}: k={int(top_k[r])} p={float(top_p[r])} min_p={float(min_p[r])}"
        assert torch.equal(out[r] > 0, ref[r] > 0), where
    torch.testing.assert_close(out, ref, **VALUE_TOL)
