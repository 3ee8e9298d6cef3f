"""Top-k, then top-p, then min-p filtering of probability rows, in the order and tie rule of the contract.

Order (docs/architecture.md, standardization): top-k (keep every token whose probability is >= the k-th
largest) -> renormalise -> top-p (keep a token iff the mass of tokens with strictly larger probability is
< p) -> renormalise -> min-p (keep tokens with probability >= min_p * max probability) -> renormalise.
Ties are always kept together, so the kept set does not depend on any ordering of equal values.
k = 0, p = 1 and min_p = 0 are no-ops.
"""

import torch


def top_k_top_p_min_p_reference(
    probs: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, min_p: torch.Tensor
) -> torch.Tensor:
    """Torch reference (and CPU path) of top-k / top-p / min-p filtering.

    Args:
        probs: fp32 ``[R, V]`` rows summing to 1.
        top_k: int32/int64 ``[R]``, 0 = off.
        top_p: fp32 ``[R]`` in (0, 1], 1 = off.
        min_p: fp32 ``[R]`` in [0, 1], 0 = off.
    Returns:
        fp32 ``[R, V]`` filtered and renormalised rows (filtered tokens are exactly 0).
    """
    out = probs.float().clone()
    vocab = out.shape[-1]
    k = top_k.long().clamp(min=0)
    k = torch.where((k == 0) | (k > vocab), torch.full_like(k, vocab), k)
    # top-k: the k-th largest value is the threshold; everything >= it survives (ties kept).
    sorted_desc = out.sort(dim=-1, descending=True).values  # (R, V)
    kth = sorted_desc.gather(-1, (k - 1)[:, None])  # (R, 1)
    out = torch.where(out >= kth, out, torch.zeros_like(out))
    out = out / out.sum(dim=-1, keepdim=True)
    # top-p: keep a token iff the mass of tokens with strictly larger probability is < p. Sorted descending,
    # that mass is the exclusive prefix sum at the first member of the token's tie run. Sums in fp64.
    sorted_desc = out.double().sort(dim=-1, descending=True).values  # (R, V)
    exclusive = sorted_desc.cumsum(dim=-1) - sorted_desc  # (R, V)
    first_of_run = torch.ones_like(sorted_desc, dtype=torch.bool)
    first_of_run[:, 1:] = sorted_desc[:, 1:] != sorted_desc[:, :-1]
    run_start_mass = torch.where(first_of_run, exclusive, torch.full_like(exclusive, -1.0)).cummax(dim=-1).values
    num_kept = (run_start_mass < top_p.double()[:, None]).sum(dim=-1, keepdim=True).clamp(min=1)  # (R, 1)
    threshold = sorted_desc.gather(-1, num_kept - 1).float()  # (R, 1) smallest kept probability
    out = torch.where(out >= threshold, out, torch.zeros_like(out))
    out = out / out.sum(dim=-1, keepdim=True)
    # min-p relative to the max probability of the renormalised row.
    row_max = out.max(dim=-1, keepdim=True).values
    out = torch.where(out >= min_p.float()[:, None] * row_max, out, torch.zeros_like(out))
    return out / out.sum(dim=-1, keepdim=True)
