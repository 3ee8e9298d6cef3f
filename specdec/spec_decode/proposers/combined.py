"""Combined drafter: a free model-free proposal when there is a match, the draft model otherwise."""

from __future__ import annotations

import torch

from specdec.cache.block_manager import BlockManager
from specdec.device import to_device
from specdec.spec_decode.proposers.base import DraftProposal, ModelFreeProposer, split_drafts
from specdec.spec_decode.proposers.draft_model import DraftModelProposer
from specdec.spec_decode.request import RequestView


class CombinedProposer:
    """A model-free proposer first; the draft model for the requests it has nothing for."""

    def __init__(self, lookup: ModelFreeProposer, draft_model: DraftModelProposer):
        self.lookup = lookup  # a model-free proposer (prompt lookup or n-gram)
        self.draft_model = draft_model  # ``Proposer.draft_model``: the model it falls back to
        self.max_positions = draft_model.max_positions

    @property
    def block_managers(self) -> list[BlockManager]:
        return self.draft_model.block_managers

    def propose(self, seqs: list[RequestView], num_tokens: list[int]) -> DraftProposal:
        free = self.lookup.propose(seqs, num_tokens)
        # requests without a model-free match go to the draft model (which catches its cache up first)
        misses = [i for i, (d, k) in enumerate(zip(free.token_ids, num_tokens)) if not d and k > 0]
        if not misses:
            return free
        model = self.draft_model.propose([seqs[i] for i in misses], [num_tokens[i] for i in misses])
        model_counts = model.counts()
        counts = list(free.counts())
        is_onehot = list(free.is_onehot)
        forwards = [0] * len(counts)
        from_model: dict[int, int] = {}
        for j, i in enumerate(misses):
            counts[i] = model_counts[j]
            is_onehot[i] = model.is_onehot[j]
            forwards[i] = model.draft_forwards[j] if model.draft_forwards else 0
            from_model[i] = j
        model_offsets = [0]
        for n in model_counts:
            model_offsets.append(model_offsets[-1] + n)
        model_host = model.token_ids
        if model_host is None and any(s.params.needs_host_drafts for s in seqs):
            # a lookup request's penalties or grammar read every draft of the round on the host (the model's were
            # left on the device because none of ITS requests needed them): one read
            model_host = split_drafts(model.device_ids.tolist(), model_counts)
        host = None  # the drafts on the host, if the model's are (penalties, grammars, a model-free stand-in)
        if model_host is not None:
            host = [model_host[from_model[i]] if i in from_model else d for i, d in enumerate(free.token_ids)]
        device_ids, bad_rows = None, None
        if model.device_ids is not None:  # the drafts stay on the device: the model's rows, then the lookup's
            rows, lookup_flat = [], []
            for i, n in enumerate(counts):
                j = from_model.get(i)
                if j is not None:
                    rows += range(model_offsets[j], model_offsets[j + 1])
                else:
                    start = model_offsets[-1] + len(lookup_flat)
                    rows += range(start, start + n)
                    lookup_flat += free.token_ids[i]
            device = model.device_ids.device
            index = to_device(rows, torch.int64, device)
            lookup_ids = to_device(lookup_flat, torch.int64, device)
            device_ids = torch.cat([model.device_ids, lookup_ids])[index]
            if model.bad_rows is not None:
                bad_rows = torch.cat([model.bad_rows, torch.zeros_like(lookup_ids, dtype=torch.bool)])[index]
        probs = None
        if model.probs is not None:
            # rows of q in request order: zeros for one-hot requests (never read), the model's q otherwise
            probs = torch.zeros(sum(counts), model.probs.shape[1], dtype=model.probs.dtype, device=model.probs.device)
            row = 0
            for i, n in enumerate(counts):
                j = from_model.get(i)
                if j is not None and not is_onehot[i]:
                    probs[row : row + n] = model.probs[model_offsets[j] : model_offsets[j + 1]]
                row += n
        return DraftProposal(host, probs, is_onehot, forwards, device_ids=device_ids, bad_rows=bad_rows,
                             num_drafts=counts)

    def propose_tree(self, seqs: list[RequestView], max_depths: list[int], max_nodes: list[int]) -> DraftProposal:
        """The lookup's tree where it has one; the draft model's tree (its chain of ``min(depth, nodes)``
        drafts if it has no tree mode) for the requests the lookup had nothing for."""
        free = self.lookup.propose_tree(seqs, max_depths, max_nodes)
        misses = [i for i, t in enumerate(free.trees) if t.num_drafts == 0 and min(max_depths[i], max_nodes[i]) > 0]
        if not misses:
            return free
        sub = [seqs[i] for i in misses]
        model = self.draft_model.propose_tree(sub, [max_depths[i] for i in misses], [max_nodes[i] for i in misses])
        model_trees, model_probs = model.trees, model.probs
        trees, is_onehot = list(free.trees), list(free.is_onehot)
        forwards = [0] * len(trees)
        for j, i in enumerate(misses):
            trees[i], is_onehot[i] = model_trees[j], model.is_onehot[j]
            forwards[i] = model.draft_forwards[j] if model.draft_forwards else 0
        probs = None
        if model_probs is not None:
            # rows in request order, n_b + 1 per request: zeros for one-hot requests (never read)
            probs = model_probs.new_zeros(sum(t.num_drafts + 1 for t in trees), model_probs.shape[1])
            model_offsets = [0]
            for t in model_trees:
                model_offsets.append(model_offsets[-1] + t.num_drafts + 1)
            from_model = {i: j for j, i in enumerate(misses)}
            row = 0
            for i, t in enumerate(trees):
                j = from_model.get(i)
                if j is not None and not is_onehot[i]:
                    probs[row : row + t.num_drafts + 1] = model_probs[model_offsets[j] : model_offsets[j + 1]]
                row += t.num_drafts + 1
        return DraftProposal([list(t.token_ids[1:]) for t in trees], probs, is_onehot, forwards, trees)

    aux_hidden_layers = None  # neither part reads the target's hidden states
    candidate_width = None  # it reads none of the target's top-k ids

    def take_candidates(self, seq_ids: list[int], tokens: list[int], candidates: list[list[int]]) -> None:
        pass  # never called (``candidate_width`` is None)

    def take_hidden_states(self, seq_ids: list[int], starts: list[int], counts: list[int],
                           hidden: torch.Tensor) -> None:
        pass  # never called (``aux_hidden_layers`` is None)

    def move_accepted_path(self, request: RequestView, accepted_nodes: list[int]) -> None:
        self.draft_model.move_accepted_path(request, accepted_nodes)  # the lookup keeps no cache

    def rollback(self, request: RequestView, kv_len: int) -> None:
        self.lookup.rollback(request, kv_len)
        self.draft_model.rollback(request, kv_len)

    def discard(self, request: RequestView, kv_len: int) -> None:
        self.draft_model.discard(request, kv_len)

    def free(self, seq_id: int, finished: bool) -> None:
        self.lookup.free(seq_id, finished)
        self.draft_model.free(seq_id, finished)
