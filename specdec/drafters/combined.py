"""Combined drafter: a free model-free proposal when there is a match, the draft model otherwise."""

from __future__ import annotations

import torch

from specdec.drafters.base import DraftProposal
from specdec.drafters.draft_model import DraftModelDrafter
from specdec.engine.sequence import Sequence


class CombinedDrafter:
    def __init__(self, lookup, draft_model: DraftModelDrafter):
        self.lookup = lookup  # a model-free drafter (prompt lookup or n-gram)
        self.draft_model = draft_model

    def propose(self, seqs: list[Sequence], num_tokens: list[int]) -> DraftProposal:
        free = self.lookup.propose(seqs, num_tokens)
        # requests without a model-free match go to the draft model (which catches its cache up first)
        misses = [i for i, (d, k) in enumerate(zip(free.token_ids, num_tokens)) if not d and k > 0]
        if not misses:
            return free
        model = self.draft_model.propose([seqs[i] for i in misses], [num_tokens[i] for i in misses])
        drafts = list(free.token_ids)
        is_onehot = list(free.is_onehot)
        forwards = [0] * len(drafts)
        from_model: dict[int, int] = {}
        for j, i in enumerate(misses):
            drafts[i] = model.token_ids[j]
            is_onehot[i] = model.is_onehot[j]
            forwards[i] = model.draft_forwards[j] if model.draft_forwards else 0
            from_model[i] = j
        probs = None
        if model.probs is not None:
            # rows of q in request order: zeros for one-hot requests (never read), the model's q otherwise
            probs = torch.zeros(sum(len(d) for d in drafts), model.probs.shape[1], dtype=model.probs.dtype,
                                device=model.probs.device)
            model_offsets = [0]
            for d in model.token_ids:
                model_offsets.append(model_offsets[-1] + len(d))
            row = 0
            for i, d in enumerate(drafts):
                j = from_model.get(i)
                if j is not None and not is_onehot[i]:
                    probs[row : row + len(d)] = model.probs[model_offsets[j] : model_offsets[j + 1]]
                row += len(d)
        return DraftProposal(drafts, probs, is_onehot, forwards)

    def rollback(self, seq: Sequence, kv_len: int) -> None:
        self.lookup.rollback(seq, kv_len)
        self.draft_model.rollback(seq, kv_len)

    def free(self, seq: Sequence) -> None:
        self.lookup.free(seq)
        self.draft_model.free(seq)
