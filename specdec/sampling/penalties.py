"""Penalty context for a batch of rows: which tokens each row has seen, and how often each was generated."""

from __future__ import annotations

import torch


def penalty_context(
    prompts: list[list[int]], outputs: list[list[int]], vocab_size: int, device: torch.device | str
) -> tuple[torch.Tensor, torch.Tensor]:
    """(seen_mask bool [R, V], output_counts int32 [R, V]).

    ``seen_mask`` marks tokens in prompt or output (repetition penalty); ``output_counts`` counts tokens in the
    output only (presence / frequency penalties, as vLLM and OpenAI define them). For speculative rows the
    "output" of draft position j is the generated text plus the drafts before j.
    """
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
