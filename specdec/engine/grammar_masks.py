"""Which logits rows of an engine step each constrained request's grammar masks, and with what.

A plain row (a decode, a prefill's last chunk) is masked by the grammar state after the committed output. A
verification window's row j by the state after the committed output and the window's first j drafts (a tree: the
drafts on the path to node j), so the target's p at every row is the constrained distribution there - which is
all verification needs to stay lossless, whatever the drafts were: a draft the grammar refuses has p = 0 and is
rejected. Draft models draw from q masked the same way (``chain_drafting.sample_draft_step``), so theirs are not
refused.
"""

from __future__ import annotations

import numpy as np
import torch

from specdec.engine.sequence import Sequence
from specdec.runner.model_runner import ForwardItem
from specdec.spec_decode.round import SpeculativeRound
from specdec.structured.masking import mask_logits


def mask_step_logits(logits: torch.Tensor, seqs: list[Sequence], items: list[ForwardItem],
                     logits_starts: list[int], spec_round: SpeculativeRound | None) -> None:
    """Mask, in place, the rows of ``logits`` (fp32 ``[R, V]``, the step's every row) of the requests with a
    grammar (``seq.grammar``). ``logits_starts[i]``: the first row of ``items[i]``."""
    rows: list[int] = []
    masks: list[np.ndarray] = []
    for i, seq in enumerate(seqs):
        grammar = seq.grammar
        if grammar is None or not items[i].num_logits:
            continue
        first = logits_starts[i]
        b = spec_round.index.get(seq.seq_id) if spec_round is not None else None
        if b is None:  # a plain row
            rows.append(first)
            masks.append(grammar.allowed()[None])
        elif spec_round.is_tree:
            tree = spec_round.meta.trees[b]
            for node in range(len(tree.token_ids)):
                rows.append(first + node)
                masks.append(grammar.allowed_after(tree.path_tokens(node))[None])
        else:
            drafts = spec_round.meta.draft_token_ids_host
            if drafts is None:
                raise RuntimeError("a grammar needs the drafts on the host, but the proposer left them on the device")
            rows += range(first, first + len(drafts[b]) + 1)
            masks.append(grammar.allowed_along(drafts[b]))
    if rows:
        mask_logits(logits, rows, np.concatenate(masks))
