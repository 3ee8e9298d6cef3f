"""Penalty context for a batch of rows: which tokens each row has seen, and how often each was generated.

The context is sparse - per row, each **distinct** token of prompt + output (+ the drafts before a draft
position) once, with its count in the output - because that is all the penalties touch: a row of a long request
has a few hundred distinct tokens against a vocabulary of 10^5. A row's context is a :data:`PenaltyCounts`
pair; the engine takes it from the request's token history (``Sequence.penalty_counts``, O(distinct tokens));
:func:`row_counts` counts any two lists with numpy (O(length)). :func:`penalty_rows` stacks the rows' contexts
with one host to device copy; :func:`penalty_context` is the same context as dense ``[R, V]`` tensors (the
reference the tests compare the sparse path against).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from specdec.device import to_device


@dataclass
class PenaltyRows:
    """The sparse penalty context of ``num_rows`` rows: entry i is token ``tokens[i]`` of row ``rows[i]``.

    Each (row, token) appears once; a row's entries are the tokens it has seen (prompt, output, earlier drafts -
    the repetition penalty's set) and ``counts`` their occurrences in the output (+ drafts): the presence and
    frequency penalties' counts, 0 for tokens seen in the prompt only. Rows without penalties may have none.
    """

    rows: torch.Tensor  # int64 [N]
    tokens: torch.Tensor  # int64 [N], each < vocab size
    counts: torch.Tensor  # int32 [N], >= 0
    num_rows: int

    def dense(self, vocab_size: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``(seen_mask bool [R, V], output_counts int32 [R, V])``: the same context, dense."""
        device = self.rows.device
        seen = torch.zeros(self.num_rows, vocab_size, dtype=torch.bool, device=device)
        counts = torch.zeros(self.num_rows, vocab_size, dtype=torch.int32, device=device)
        seen[self.rows, self.tokens] = True
        counts[self.rows, self.tokens] = self.counts
        return seen, counts


PenaltyCounts = tuple[np.ndarray, np.ndarray]  # (ids int64 [D], counts int32 [D]): a row's distinct tokens


def row_counts(prompt: list[int], output: list[int]) -> PenaltyCounts:
    """``(ids int64 [D], counts int32 [D])`` of one row: each distinct token of ``prompt + output`` once, with its
    count in ``output`` (O(length); a request's own history hands the same over in O(distinct))."""
    p = np.asarray(prompt, dtype=np.int64).reshape(-1)  # [Lp]
    o = np.asarray(output, dtype=np.int64).reshape(-1)  # [Lo]
    ids, inverse = np.unique(np.concatenate([p, o]), return_inverse=True)  # [D], [Lp + Lo]
    counts = np.bincount(inverse[p.size :], minlength=ids.size).astype(np.int32)  # [D]
    return ids, counts


def penalty_rows(contexts: list[PenaltyCounts | None], vocab_size: int, device: torch.device | str) -> PenaltyRows:
    """The sparse penalty context of ``len(contexts)`` rows (one host to device copy).

    ``contexts[r]``: row r's distinct tokens and their counts in its "output" (the generated text, plus the drafts
    before draft position j for a speculative row), or None for a row without penalties (no entries; its logits
    are left alone either way). Ids at or beyond ``vocab_size`` are dropped (no logit to penalise: a draft model
    with a smaller vocabulary than its target's).
    """
    num_rows = len(contexts)
    ids, counts, sizes = [], [], np.zeros(num_rows, dtype=np.int64)
    for r, context in enumerate(contexts):
        if context is None:
            continue
        i, c = context
        keep = i < vocab_size
        if not keep.all():
            i, c = i[keep], c[keep]
        ids.append(i)
        counts.append(c)
        sizes[r] = i.size
    flat = np.empty((3, int(sizes.sum())), dtype=np.int64)  # rows, tokens, counts: one copy to the device
    flat[0] = np.repeat(np.arange(num_rows), sizes)
    if ids:
        np.concatenate(ids, out=flat[1])
        np.concatenate(counts, out=flat[2], casting="unsafe")
    table = to_device(flat, torch.int64, device)
    return PenaltyRows(table[0], table[1], table[2].int(), num_rows)


def penalty_context(contexts: list[PenaltyCounts | None], vocab_size: int, device: torch.device | str
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """(seen_mask bool [R, V], output_counts int32 [R, V]): :func:`penalty_rows` as dense tensors.

    ``seen_mask`` marks tokens in prompt or output (repetition penalty); ``output_counts`` counts tokens in the
    output only (presence / frequency penalties, as vLLM and OpenAI define them). ``apply_penalty_rows`` applies
    the sparse form at O(entries) instead of O(R * V).
    """
    return penalty_rows(contexts, vocab_size, device).dense(vocab_size)
