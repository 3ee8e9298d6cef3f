"""Plain (non-speculative) next-token sampling: penalties -> standardize -> exact sampling by Philox noise."""

from __future__ import annotations

import torch

from specdec.kernels.philox import STREAM_SAMPLE, row_exponentials
from specdec.sampling.params import SamplingParams
from specdec.sampling.standardize import SamplingTensors, apply_penalties, standardize


def penalty_context(
    prompts: list[list[int]], outputs: list[list[int]], vocab_size: int, device: torch.device | str
) -> tuple[torch.Tensor, torch.Tensor]:
    """(seen_mask bool [R, V], output_counts int32 [R, V]) for the penalties of each row."""
    rows = len(prompts)
    seen = torch.zeros(rows, vocab_size, dtype=torch.bool, device=device)
    counts = torch.zeros(rows, vocab_size, dtype=torch.int32, device=device)
    for r, (prompt, out) in enumerate(zip(prompts, outputs)):
        if prompt:
            seen[r, torch.tensor(prompt, device=device)] = True
        if out:
            ids = torch.tensor(out, dtype=torch.int64, device=device)
            seen[r, ids] = True
            counts[r].index_add_(0, ids, torch.ones_like(ids, dtype=torch.int32))
    return seen, counts


def greedy(logits: torch.Tensor) -> torch.Tensor:
    """The one argmax every greedy path uses (plain decoding and speculative verification): int64 ``[R]``."""
    return logits.argmax(dim=-1)


def sample_from_probs(probs: torch.Tensor, seeds: torch.Tensor, positions: torch.Tensor, stream: int) -> torch.Tensor:
    """Exact categorical sampling ``argmax(p / E)``, E ~ Exp(1) from Philox(seed, position, stream): int64 ``[R]``."""
    noise = row_exponentials(seeds, positions, stream, probs.shape[-1]).to(probs.device)  # (R, V)
    return (probs / noise).argmax(dim=-1)


def sample_next_tokens(
    logits: torch.Tensor,
    params: list[SamplingParams],
    seeds: list[int],
    positions: list[int],
    prompts: list[list[int]],
    outputs: list[list[int]],
) -> torch.Tensor:
    """Next token per row, int64 ``[R]``; raises ``FloatingPointError`` on NaN/inf logits.

    Args:
        logits: fp32 ``[R, V]``.
        seeds, positions: per row, the request seed and the absolute position of the token being sampled.
        prompts, outputs: per row, the token context for penalties.
    """
    device = logits.device
    st = SamplingTensors.from_params(params, device)
    if st.any_penalty:
        seen, counts = penalty_context(prompts, outputs, logits.shape[-1], device)
        logits = apply_penalties(logits, seen, counts, st)
    if st.all_greedy:
        finite = torch.isfinite(logits).all(dim=-1)
        if not bool(finite.all()):
            rows = (~finite).nonzero().flatten().tolist()
            raise FloatingPointError(f"non-finite logits (NaN or inf) in rows {rows}; refusing to decode them")
        return greedy(logits)
    probs = standardize(logits, st)
    seed_t = torch.tensor(seeds, dtype=torch.int64, device=device)
    pos_t = torch.tensor(positions, dtype=torch.int64, device=device)
    sampled = sample_from_probs(probs, seed_t, pos_t, STREAM_SAMPLE)
    return torch.where(st.temperature == 0, greedy(logits), sampled)
