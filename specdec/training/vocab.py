"""The draft vocabulary: the D most frequent target tokens in the training answers (EAGLE-3's reduced LM head)."""

from __future__ import annotations

from collections.abc import Iterable

import torch


def draft_vocab(answers: Iterable[list[int]], vocab_size: int, draft_vocab_size: int
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """``(d2t int64 [D], t2d bool [V])`` for the ``D = draft_vocab_size`` most frequent ids of ``answers`` (ties
    and ids never seen filled by lowest id): draft id i is target id ``i + d2t[i]``, the target ids ascending
    (the published layout's convention); ``t2d`` marks them. ``ValueError`` if D is not in ``[1, V]``."""
    if not 1 <= draft_vocab_size <= vocab_size:
        raise ValueError(f"--draft-vocab-size must be in [1, {vocab_size}] (the target's vocabulary), "
                         f"got {draft_vocab_size}")
    counts = torch.zeros(vocab_size, dtype=torch.int64)
    for ids in answers:
        if ids:
            counts += torch.bincount(torch.tensor(ids, dtype=torch.int64), minlength=vocab_size)[:vocab_size]
    # stable sort by count, descending: equal counts keep the lower id first
    order = torch.sort(counts, descending=True, stable=True).indices
    target_ids = order[:draft_vocab_size].sort().values  # int64 [D] ascending
    d2t = target_ids - torch.arange(draft_vocab_size)
    t2d = torch.zeros(vocab_size, dtype=torch.bool)
    t2d[target_ids] = True
    return d2t, t2d


def coverage(answers: Iterable[list[int]], t2d: torch.Tensor) -> float:
    """The fraction of answer tokens inside the draft vocabulary."""
    inside = total = 0
    for ids in answers:
        if ids:
            t = torch.tensor(ids, dtype=torch.int64)
            inside += int(t2d[t].sum())
            total += t.numel()
    return inside / max(total, 1)
