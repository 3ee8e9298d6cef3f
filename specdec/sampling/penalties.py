"""Penalty context for a batch of rows: which tokens each row has seen, and how often each was generated.

The context is sparse - per row, each **distinct** token of prompt + output (+ the drafts before a draft
position) once, with its count in the output - because that is all the penalties touch: a row of a long request
has a few hundred distinct tokens against a vocabulary of 10^5. :func:`penalty_rows` builds it with one host to
device copy; :func:`penalty_context` is the same context as dense ``[R, V]`` tensors (the reference the tests
compare the sparse path against).

Per row, the counts come from the request's ``TokenHistory`` (engine/token_history.py: kept up to date per
appended token, O(distinct) to hand over) when the row's lists are the sequence's own (``seq.prompt_token_ids``
with ``seq.output_token_ids`` or ``seq.output_token_ids + drafts``); any other lists are counted with numpy
(O(length)).
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


def row_counts(prompt: list[int], output: list[int], vocab_size: int) -> tuple[np.ndarray, np.ndarray]:
    """``(ids int64 [D], counts int32 [D])`` of one row: each distinct token of ``prompt + output`` below
    ``vocab_size`` once (ids at or beyond it have no logit to penalise), with its count in ``output``.

    O(distinct tokens) when ``prompt`` / ``output`` are a sequence's own lists (see the module docstring),
    O(length) otherwise.
    """
    source = getattr(output, "penalty_source", None)
    source = source() if source is not None else None  # (TokenHistory, extra tokens) or None
    if source is not None and getattr(prompt, "history", None) is source[0]:
        ids, counts = source[0].penalty_counts(source[1])
    else:
        p = np.asarray(prompt, dtype=np.int64).reshape(-1)  # [Lp]
        o = np.asarray(output, dtype=np.int64).reshape(-1)  # [Lo]
        ids, inverse = np.unique(np.concatenate([p, o]), return_inverse=True)  # [D], [Lp + Lo]
        counts = np.bincount(inverse[p.size :], minlength=ids.size).astype(np.int32)  # [D]
    keep = ids < vocab_size
    if not keep.all():
        ids, counts = ids[keep], counts[keep]
    return ids, counts


def penalty_rows(prompts: list[list[int]], outputs: list[list[int]], vocab_size: int, device: torch.device | str,
                 active: list[bool] | None = None) -> PenaltyRows:
    """The sparse penalty context of ``len(prompts)`` rows (one host to device copy).

    ``outputs[r]`` is row r's "output": the generated text, plus the drafts before draft position j for a
    speculative row. ``active``: per row, whether it has penalties at all (rows without get no entries; their
    logits are left alone either way).
    """
    num_rows = len(prompts)
    if len(outputs) != num_rows:
        raise ValueError(f"one output list per prompt: got {num_rows} prompts and {len(outputs)} outputs")
    ids, counts, sizes = [], [], np.zeros(num_rows, dtype=np.int64)
    for r, (prompt, out) in enumerate(zip(prompts, outputs)):
        if active is not None and not active[r]:
            continue
        i, c = row_counts(prompt, out, vocab_size)
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


def penalty_context(
    prompts: list[list[int]], outputs: list[list[int]], vocab_size: int, device: torch.device | str
) -> tuple[torch.Tensor, torch.Tensor]:
    """(seen_mask bool [R, V], output_counts int32 [R, V]).

    ``seen_mask`` marks tokens in prompt or output (repetition penalty); ``output_counts`` counts tokens in the
    output only (presence / frequency penalties, as vLLM and OpenAI define them). For speculative rows the
    "output" of draft position j is the generated text plus the drafts before j. The dense form of
    :func:`penalty_rows` (which ``apply_penalty_rows`` applies at O(entries) instead of O(R * V)).
    """
    return penalty_rows(prompts, outputs, vocab_size, device).dense(vocab_size)
