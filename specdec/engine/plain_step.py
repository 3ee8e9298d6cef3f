"""The plain (non-speculative) part of a step: a request's next chunk as a forward item, and its next token."""

from __future__ import annotations

import torch

from specdec.engine.model_runner import ForwardItem
from specdec.engine.sequence import Sequence
from specdec.sampling.sampler import sample_next_tokens


def plain_item(seq: Sequence, num_new: int) -> ForwardItem:
    """The next ``num_new`` tokens of ``seq``; logits only if they complete it (then a token is sampled)."""
    tokens = seq.all_token_ids[seq.num_computed : seq.num_computed + num_new]
    completes = seq.num_computed + num_new == seq.num_tokens
    return ForwardItem(seq.seq_id, tokens, seq.num_computed, 1 if completes else 0)


def sample_plain(logits: torch.Tensor, seqs: list[Sequence]) -> dict[int, list[int]]:
    """One sampled token per sequence from its logits row ``[len(seqs), V]``; the tokens and the NaN/inf check
    come to the host in one read, and ``FloatingPointError`` names the requests whose rows are bad."""
    if not seqs:
        return {}
    return plain_tokens_from_host(sample_plain_on_device(logits, seqs).tolist(), seqs)  # the step's one host read


def sample_plain_on_device(logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
    """int64 ``[2 * len(seqs)]`` on the device: the token sampled from each row of ``logits`` ``[len(seqs), V]``,
    then each row's NaN/inf flag - for the caller's one host read (a speculative step's verification read carries
    it when plain rows ride in the same forward)."""
    bad_rows: list[torch.Tensor] = []
    tokens = sample_next_tokens(
        logits, [s.params for s in seqs], [s.seed for s in seqs], [s.num_tokens for s in seqs],
        [s.prompt_token_ids for s in seqs], [s.output_token_ids for s in seqs], bad_rows=bad_rows,
    )
    return torch.cat([tokens, bad_rows[0].long()])


def plain_tokens_from_host(host: list[int], seqs: list[Sequence]) -> dict[int, list[int]]:
    """seq id -> [its token] from the host copy of :func:`sample_plain_on_device`; ``FloatingPointError`` names the
    requests whose rows were NaN/inf."""
    n = len(seqs)
    names = [s.request_id for s, flag in zip(seqs, host[n:]) if flag]
    if names:
        raise FloatingPointError(f"non-finite logits (NaN or inf) for requests {names}; refusing to sample from them")
    return {s.seq_id: [t] for s, t in zip(seqs, host[:n])}
