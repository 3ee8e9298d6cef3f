"""The draft vocabulary: the D most frequent target tokens in the target's answers (EAGLE-3's reduced LM head, and a
draft model's ``SpeculativeConfig(draft_vocab=)``, written by ``specdec draft-vocab``: vocab_command.py)."""

from __future__ import annotations

from collections.abc import Iterable

import torch


def ranked_ids(answers: Iterable[list[int]], vocab_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(ids int64 [V], counts int64 [V])``: every id of the vocabulary, most frequent in ``answers`` first (ties and
    ids never seen by lowest id), with its count. ``ValueError`` on an id outside ``[0, V)``."""
    counts = torch.zeros(vocab_size, dtype=torch.int64)
    for ids in answers:
        if ids:
            t = torch.tensor(ids, dtype=torch.int64)
            if int(t.min()) < 0 or int(t.max()) >= vocab_size:
                raise ValueError(f"answer token id {int(t.max()) if int(t.max()) >= vocab_size else int(t.min())} is "
                                 f"outside the target's vocabulary [0, {vocab_size})")
            counts += torch.bincount(t, minlength=vocab_size)
    # stable sort by count, descending: equal counts keep the lower id first
    order = torch.sort(counts, descending=True, stable=True).indices
    return order, counts[order]


def draft_vocab(answers: Iterable[list[int]], vocab_size: int, draft_vocab_size: int
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """``(d2t int64 [D], t2d bool [V])`` for the ``D = draft_vocab_size`` most frequent ids of ``answers``
    (:func:`ranked_ids`): draft id i is target id ``i + d2t[i]``, the target ids ascending (the published layout's
    convention); ``t2d`` marks them. ``ValueError`` if D is not in ``[1, V]``."""
    if not 1 <= draft_vocab_size <= vocab_size:
        raise ValueError(f"--draft-vocab-size must be in [1, {vocab_size}] (the target's vocabulary), "
                         f"got {draft_vocab_size}")
    order, _ = ranked_ids(answers, vocab_size)
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
