"""The Drafter protocol: propose up to k tokens per request, with the q they were sampled from (or one-hot).

A drafter never knows about verification, and the verifier never knows which drafter ran: that is what lets
a new drafter arrive without touching the accept/reject logic.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from specdec.drafters.tree import DraftTree
from specdec.engine.sequence import Sequence


@dataclass
class DraftProposal:
    """Ragged drafts of one batch, flattened (vLLM's spec-decode metadata layout)."""

    token_ids: list[list[int]]  # per request, its draft tokens (len k_b <= asked k_b; may be 0); for a tree,
    #                             its drafted nodes' tokens in DFS order (tree.token_ids[1:])
    probs: torch.Tensor | None  # fp32 [sum(k_b), V_target] q of each draft token's position, or None if one-hot;
    #                             with ``trees``: [sum(n_b + 1), V_target], row i of request b = q at its node i
    #                             (what node i's children were drawn from without replacement; leaf rows unread)
    is_onehot: list[bool]  # per request: deterministic drafts (q is one-hot at the token)
    draft_forwards: list[int] | None = None  # per request: draft-model forwards it took part in (None = none)
    trees: list[DraftTree] | None = None  # per request its tree (a chain is a tree), or None: chains only


class Drafter(Protocol):
    def propose(self, seqs: list[Sequence], num_tokens: list[int]) -> DraftProposal:
        """Draft up to ``num_tokens[i]`` tokens after the last token of ``seqs[i]``."""
        ...

    def rollback(self, seq: Sequence, kv_len: int) -> None:
        """The target kept ``kv_len`` tokens of ``seq`` in its cache; drop any draft state beyond them."""
        ...

    def free(self, seq: Sequence) -> None:
        """``seq`` left the engine (finished, aborted or preempted)."""
        ...
