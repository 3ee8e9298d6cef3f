"""The Proposer protocol: propose up to k tokens (or a token tree) per request, with the q they were sampled
from (or one-hot).

A proposer never knows about verification, and the verifier never knows which proposer ran: that is what lets
a new drafter arrive without touching the accept/reject logic. A proposer reads requests through
:class:`~specdec.spec_decode.request.RequestView` (the engine's ``Sequence`` is one) and never imports the engine.
A proposer that keeps a KV cache (a draft model) owns it: its pools (``block_managers``, allocated by the
scheduler in lockstep with the target's), its rollback and the move of a tree round's accepted path.

:class:`Proposer` declares everything the round asks of a proposer - the model it drafts with (``draft_model``),
the target hidden states it reads (``aux_hidden_layers``, ``take_hidden_states``) - so nothing above it probes
types. Model drafters share their drafting loops through ``model_drafter.ModelDrafter``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import torch

from specdec.cache.block_manager import BlockManager
from specdec.device import to_device
from specdec.spec_decode.request import RequestView
from specdec.spec_decode.tree import DraftTree

if TYPE_CHECKING:  # the annotation only
    from specdec.spec_decode.proposers.model_drafter import DraftModel


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


class Proposer(Protocol):
    """What a speculative round asks of a drafter (specdec/spec_decode/proposers/factory.py builds one)."""

    block_managers: list[BlockManager]  # KV pools the scheduler allocates with the target's ([] if it has none)
    max_positions: int | None  # the highest position it can draft at + 1 (None: no limit)
    # the draft model it drafts with (itself, or a combined proposer's), or None: calibration times its step, the
    # engine captures its static forwards and draft loop
    draft_model: DraftModel | None
    # the target layers whose hidden states it reads (the target forward then captures them), or None: none
    aux_hidden_layers: tuple[int, ...] | None
    # how many of the target's top ids per logits row it reads (``take_candidates``), or None: none - the step then
    # computes no top-k
    candidate_width: int | None

    def propose(self, requests: list[RequestView], num_tokens: list[int]) -> DraftProposal:
        """Draft up to ``num_tokens[i]`` tokens after the last token of ``requests[i]`` (0: none for it)."""
        ...

    def propose_tree(self, requests: list[RequestView], max_depths: list[int], max_nodes: list[int]) -> DraftProposal:
        """A draft tree per request (``DraftProposal.trees``): depth <= ``max_depths[i]``, at most ``max_nodes[i]``
        drafted nodes; a tree with no drafted node means nothing to verify for that request."""
        ...

    def take_hidden_states(self, seq_ids: list[int], starts: list[int], counts: list[int],
                           hidden: torch.Tensor) -> None:
        """The target's hidden states ``[sum(counts), len(aux_hidden_layers) * H]`` of the tokens each request keeps
        after this step: ``counts[i]`` of request ``seq_ids[i]`` from position ``starts[i]`` on, request-major
        (beyond the committed KV until the commit: ``discard`` drops them). Called only if ``aux_hidden_layers``."""
        ...

    def take_candidates(self, seq_ids: list[int], tokens: list[int], candidates: list[list[int]]) -> None:
        """Every logits row of the step, after its host read: row i was computed for request ``seq_ids[i]`` with
        input token ``tokens[i]``, and ``candidates[i]`` are the target's top ``candidate_width`` ids of that row
        (unconstrained logits, best first). Called only if ``candidate_width``."""
        ...

    def move_accepted_path(self, request: RequestView, accepted_nodes: list[int]) -> None:
        """At the commit of a tree round, before the rollback: keep the accepted path's state (``accepted_nodes``:
        its nodes at depth 1..n, DFS indices of the request's last proposed tree; the root at
        ``request.num_computed``, not yet advanced)."""
        ...

    def rollback(self, request: RequestView, kv_len: int) -> None:
        """A round was committed: the target kept ``kv_len`` tokens of ``request`` in its cache; drop any draft
        state beyond them and give back whole KV blocks beyond them."""
        ...

    def discard(self, request: RequestView, kv_len: int) -> None:
        """A step failed: forget draft state beyond ``kv_len`` (the committed length), keeping the blocks the
        scheduler reserved (the step may be retried on a smaller batch)."""
        ...

    def free(self, seq_id: int, finished: bool) -> None:
        """The request left the running batch: finished (or aborted, or failed) - or preempted (``finished``
        False: it comes back later with the same tokens)."""
        ...


class ModelFreeProposer:
    """The parts of :class:`Proposer` a drafter without a KV cache (prompt lookup, n-gram) has nothing to do in."""

    max_positions: int | None = None
    draft_model = None
    aux_hidden_layers = None
    candidate_width: int | None = None

    @property
    def block_managers(self) -> list[BlockManager]:
        return []

    def take_hidden_states(self, seq_ids: list[int], starts: list[int], counts: list[int],
                           hidden: torch.Tensor) -> None:
        pass  # never called (``aux_hidden_layers`` is None)

    def take_candidates(self, seq_ids: list[int], tokens: list[int], candidates: list[list[int]]) -> None:
        pass  # never called (``candidate_width`` is None) unless a subclass reads candidates

    def move_accepted_path(self, request: RequestView, accepted_nodes: list[int]) -> None:
        pass

    def rollback(self, request: RequestView, kv_len: int) -> None:
        pass  # its state is built from emitted tokens only

    def discard(self, request: RequestView, kv_len: int) -> None:
        pass
