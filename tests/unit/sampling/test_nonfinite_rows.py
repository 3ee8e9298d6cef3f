"""sampler.nonfinite_rows (max/min reductions) flags exactly the rows an elementwise isfinite check flags."""

import pytest
import torch

from specdec.sampling.sampler import check_finite, nonfinite_rows


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("seed", range(4))
def test_nonfinite_rows_matches_isfinite(dtype, seed):
    gen = torch.Generator().manual_seed(seed)
    logits = (torch.randn(16, 257, generator=gen) * 50).to(dtype)
    for _ in range(6):  # NaN, +inf and -inf anywhere in a row, first and last columns included
        r, c = torch.randint(16, (1,), generator=gen).item(), torch.randint(257, (1,), generator=gen).item()
        logits[r, c] = [float("nan"), float("inf"), -float("inf")][torch.randint(3, (1,), generator=gen).item()]
    logits[0, 0], logits[1, -1] = float("nan"), -float("inf")
    want = ~torch.isfinite(logits).all(dim=-1)
    assert torch.equal(nonfinite_rows(logits), want) and bool(want[0]) and bool(want[1])


def test_check_finite_names_the_bad_rows():
    logits = torch.zeros(4, 5)
    check_finite(logits)
    logits[2, 4] = float("nan")
    with pytest.raises(FloatingPointError, match=r"rows \[2\]"):
        check_finite(logits)
