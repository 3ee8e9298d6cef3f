"""Assertions shared by generation tests."""

import torch


def assert_greedy_equal(got: list[int], expected: list[int], oracle_logits_fn=None, context: str = ""):
    """Token-exact greedy comparison. On divergence, report the oracle's top-2 logit gap at that position:
    a gap < 1e-4 is a numerical tie (accepted); anything else fails."""
    if got == expected:
        return
    n = next((i for i, (a, b) in enumerate(zip(got, expected)) if a != b), min(len(got), len(expected)))
    if oracle_logits_fn is None:
        raise AssertionError(f"{context}: greedy tokens diverge at {n}: {got} vs {expected}")
    logits = oracle_logits_fn(expected[:n])  # logits [V] for the position where they diverge
    top2 = torch.topk(logits.float(), 2).values
    gap = float(top2[0] - top2[1])
    assert gap < 1e-4, f"{context}: greedy tokens diverge at {n} with oracle top-2 gap {gap:.3g}: {got} vs {expected}"
