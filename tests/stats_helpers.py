"""Statistics shared by the sampling tests (no scipy needed)."""

import torch


def chi2_isf(alpha: float, df: int) -> float:
    """x with P(chi2_df > x) = alpha, by bisection on the regularized upper incomplete gamma function."""
    a = torch.tensor(df / 2.0, dtype=torch.float64)
    lo, hi = 0.0, 10.0 * df + 200.0
    for _ in range(200):
        mid = (lo + hi) / 2
        if torch.special.gammaincc(a, torch.tensor(mid / 2, dtype=torch.float64)).item() > alpha:
            lo = mid
        else:
            hi = mid
    return hi
