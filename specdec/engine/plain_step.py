"""The plain (non-speculative) rows of a step: a request's next chunk as a forward item, and its next token."""

from __future__ import annotations

import torch

from specdec.device import StepOutput
from specdec.engine.sequence import Sequence
from specdec.runner.model_runner import ForwardItem
from specdec.sampling.sampler import sample_next_tokens


def plain_item(seq: Sequence, num_new: int) -> ForwardItem:
    """The next ``num_new`` tokens of ``seq``; logits only if they complete it (then a token is sampled)."""
    tokens = seq.all_token_ids[seq.num_computed : seq.num_computed + num_new]
    completes = seq.num_computed + num_new == seq.num_tokens
    return ForwardItem(seq.seq_id, tokens, seq.num_computed, 1 if completes else 0)


def sample_plain(logits: torch.Tensor, seqs: list[Sequence], out: StepOutput) -> PendingPlain:
    """Queue one sampled token per sequence from its logits row (``logits`` fp32 ``[len(seqs), V]``); the tokens
    and the rows' NaN/inf flags come back with the step's host read (``out``)."""
    bad_rows: list[torch.Tensor] = []
    tokens = sample_next_tokens(
        logits, [s.params for s in seqs], [s.seed for s in seqs], [s.num_tokens for s in seqs],
        [s.penalty_counts() if s.params.has_penalties else None for s in seqs], bad_rows=bad_rows,
    )
    return PendingPlain(seqs, out, out.add(tokens), out.add(bad_rows[0]))


class PendingPlain:
    """The plain rows' tokens, queued on the device; :meth:`result` after the step's host read."""

    def __init__(self, seqs: list[Sequence], out: StepOutput, tokens_handle: int, bad_handle: int):
        self.seqs, self.out = seqs, out
        self.tokens_handle, self.bad_handle = tokens_handle, bad_handle

    def result(self) -> dict[int, list[int]]:
        """seq id -> [its token]; ``FloatingPointError`` names the requests whose rows were NaN/inf."""
        flags = self.out.get(self.bad_handle)
        names = [s.request_id for s, flag in zip(self.seqs, flags) if flag]
        if names:
            raise FloatingPointError(f"non-finite logits (NaN or inf) for requests {names}; refusing to sample "
                                     "from them")
        return {s.seq_id: [t] for s, t in zip(self.seqs, self.out.get(self.tokens_handle))}
