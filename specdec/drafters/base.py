"""The Drafter protocol: propose up to k tokens per request, with the q they were sampled from (or one-hot).

A drafter never knows about verification, and the verifier never knows which drafter ran: that is what lets
a new drafter arrive without touching the accept/reject logic. Neither depends on the engine's ``Sequence``:
a drafter reads a request through :class:`DraftRequest` (``engine.sequence.Sequence`` is one).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from specdec.device import to_device
from specdec.drafters.tree import DraftTree
from specdec.sampling.params import SamplingParams


class DraftRequest(Protocol):
    """What a drafter reads of a request."""

    seq_id: int
    request_id: str
    params: SamplingParams
    seed: int  # the request's randomness key
    prompt_token_ids: list[int]
    output_token_ids: list[int]

    @property
    def all_token_ids(self) -> list[int]: ...  # prompt + output

    @property
    def last_token_id(self) -> int: ...

    @property
    def num_tokens(self) -> int: ...  # len(prompt) + len(output): the position of the first draft


@dataclass
class DraftProposal:
    """Ragged drafts of one batch, flattened (vLLM's spec-decode metadata layout).

    The drafts are on the host (``token_ids``), or, from a draft model's chains, only on the device
    (``device_ids``, with ``num_drafts``) until verification's one host read brings them back with its result;
    ``bad_rows`` then carries the draft logits' NaN/inf check to that read.
    """

    token_ids: list[list[int]] | None  # per request, its draft tokens (len k_b <= asked k_b; may be 0); for a tree,
    #                                    its drafted nodes' tokens in DFS order (tree.token_ids[1:]); None while
    #                                    the drafts are only on the device
    probs: torch.Tensor | None  # fp32 [sum(k_b), V_target] q of each draft token's position, or None if one-hot;
    #                             with ``trees``: [sum(n_b + 1), V_target], row i of request b = q at its node i
    #                             (what node i's children were drawn from without replacement; leaf rows unread)
    is_onehot: list[bool]  # per request: deterministic drafts (q is one-hot at the token)
    draft_forwards: list[int] | None = None  # per request: draft-model forwards it took part in (None = none)
    trees: list[DraftTree] | None = None  # per request its tree (a chain is a tree), or None: chains only
    device_ids: torch.Tensor | None = None  # int64 [sum(k_b)] the drafts in request order, on the device (or None)
    bad_rows: torch.Tensor | None = None  # bool [sum(k_b)] drafts drawn from NaN/inf logits, not yet checked
    num_drafts: list[int] | None = None  # k_b per request; needed when ``token_ids`` is None

    def counts(self) -> list[int]:
        """k_b per request, without reading the device."""
        if self.num_drafts is not None:
            return self.num_drafts
        return [len(d) for d in self.token_ids]

    def device_token_ids(self, device: torch.device) -> torch.Tensor:
        """int64 ``[sum(k_b)]``: the drafts in request order on ``device`` (copied there from the host if needed)."""
        if self.device_ids is not None:
            return self.device_ids
        return to_device([t for d in self.token_ids for t in d], torch.int64, device)

    def read_token_ids(self, request_ids: list[str]) -> list[list[int]]:
        """The drafts on the host: ``token_ids``, or the device drafts with their NaN/inf check in one host read
        (then kept in ``token_ids``). ``request_ids`` (one per request) name the requests in the
        ``FloatingPointError`` raised for drafts drawn from NaN/inf logits."""
        if self.token_ids is None:
            both = torch.cat([self.device_ids, self.bad_rows.long()]).tolist()  # the one host read
            n = self.device_ids.shape[0]
            self.token_ids = split_drafts(both[:n], self.counts())
            check_draft_rows(both[n:], self.counts(), request_ids)
            self.bad_rows = None  # checked
        return self.token_ids


def split_drafts(flat: list[int], counts: list[int]) -> list[list[int]]:
    """``flat`` (request-major) cut into per-request lists of ``counts[b]`` items."""
    out, start = [], 0
    for n in counts:
        out.append(flat[start : start + n])
        start += n
    return out


def check_draft_rows(bad: list[int], counts: list[int], request_ids: list[str]) -> None:
    """``FloatingPointError`` naming the requests with a flagged draft row (``bad``: one 0/1 per draft token,
    request-major, ``counts[b]`` per request)."""
    failed = sorted({request_ids[b] for b, rows in enumerate(split_drafts(bad, counts)) if any(rows)})
    if failed:
        raise FloatingPointError(f"non-finite draft logits (NaN or inf) for requests {failed}; "
                                 "refusing to sample from them")


class Drafter(Protocol):
    def propose(self, seqs: list[DraftRequest], num_tokens: list[int]) -> DraftProposal:
        """Draft up to ``num_tokens[i]`` tokens after the last token of ``seqs[i]``."""
        ...

    def rollback(self, seq: DraftRequest, kv_len: int) -> None:
        """The target kept ``kv_len`` tokens of ``seq`` in its cache; drop any draft state beyond them."""
        ...

    def free(self, seq: DraftRequest) -> None:
        """``seq`` left the engine (finished, aborted or preempted)."""
        ...
