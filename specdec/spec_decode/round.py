"""SpeculativeRound: one round of speculation as data - drafted, placed in the step's forward, verified, read.

The engine's step (``engine/step.py``) drives it in order:

    Speculator.draft(...)          -> SpeculativeRound   the requests that drafted >= 1 token, their DraftProposal
    round.window(seq)              -> ForwardItem        a request's verification window in the target forward
    round.place(layout, device)    -> input ids           SpecDecodeMetadata, built once (offsets, drafts, trees)
    round.verify(logits, out)                            queued on the device; registered in the step's StepOutput
    round.read()                   -> VerifyResult       after the step's one host read

Nothing here changes a request or a cache: the round's KV edit (a tree's accepted path moved, both caches cut to
the kept KV) is the commit's, ``Speculator.finish_round``. This module never sees the engine's ``Sequence``:
requests are :class:`~specdec.spec_decode.request.RequestView`s.
"""

from __future__ import annotations

import torch

from specdec.device import StepOutput, to_device
from specdec.runner.model_runner import ForwardItem
from specdec.sampling.metadata import SamplingMetadata
from specdec.spec_decode.metadata import SpecDecodeMetadata
from specdec.spec_decode.proposers.base import DraftProposal
from specdec.spec_decode.request import RequestView
from specdec.spec_decode.verify import PendingVerification, VerifyResult, verify_round

DEVICE_DRAFT = 0  # a verification window's placeholder id for a draft that is only on the device


class SpeculativeRound:
    """The round of one step.

    Args:
        requests: every request that asked to draft (granted a lookahead > 0), in batch order.
        proposal: their drafts (None: nobody drafted); requests with no draft take a plain step.
        lookahead_granted: seq id -> the lookahead the scheduler granted, for every decode step of the batch.
        verify_method: ``SpeculativeConfig.verify`` ("token" or "block", for chains).
        vocab_size: the target's (the sampling metadata of the window rows).
    """

    def __init__(self, requests: list[RequestView], proposal: DraftProposal | None,
                 lookahead_granted: dict[int, int], verify_method: str, vocab_size: int):
        counts = proposal.counts() if proposal is not None else [0] * len(requests)
        keep = [i for i, n in enumerate(counts) if n]
        forwards = (proposal.draft_forwards if proposal is not None else None) or [0] * len(requests)
        self.requests = [requests[i] for i in keep]  # requests that verify, in batch order
        self.proposal = _select(proposal, keep) if keep else None  # restricted to ``self.requests``
        self.lookahead_granted = lookahead_granted
        self.draft_forwards = {r.seq_id: f for r, f in zip(requests, forwards)}  # seq id -> draft forwards
        self.index = {r.seq_id: b for b, r in enumerate(self.requests)}  # seq id -> its window's index b
        proposal = self.proposal
        self.is_tree = proposal is not None and proposal.trees is not None
        # per window: the draft positions it verifies - a chain's length, a tree's depth (its nodes: the proposal)
        self.drafted = ([t.max_depth for t in proposal.trees] if self.is_tree
                        else proposal.counts() if proposal is not None else [])
        self.verify_method, self.vocab_size = verify_method, vocab_size
        self.meta: SpecDecodeMetadata | None = None  # set by place()
        self._pending: PendingVerification | None = None  # set by verify()
        self.result: VerifyResult | None = None  # set by read()

    # --- the target forward's layout -------------------------------------------------------------------------
    def window(self, seq: RequestView) -> ForwardItem:
        """Request ``seq``'s verification window: its last token then its drafts (a tree: its nodes in DFS order,
        node i at RoPE position ctx + depth(i)); every row's logits are wanted."""
        b, proposal = self.index[seq.seq_id], self.proposal
        if proposal.trees is not None:
            tree = proposal.trees[b]
            return ForwardItem(seq.seq_id, list(tree.token_ids), seq.num_computed, len(tree.token_ids),
                               positions=[seq.num_computed + depth for depth in tree.depths], mask=tree.mask())
        k = self.drafted[b]  # a chain's length
        drafts = proposal.token_ids[b] if proposal.token_ids is not None else [DEVICE_DRAFT] * k
        return ForwardItem(seq.seq_id, [seq.last_token_id, *drafts], seq.num_computed, k + 1)

    def place(self, logits_starts: list[int], input_starts: list[int], num_logits: int, host_ids: list[int],
              device: torch.device) -> torch.Tensor | None:
        """The step laid out its forward: window b starts at logits row ``logits_starts[b]`` and flat input position
        ``input_starts[b]``, of ``num_logits`` rows and input ids ``host_ids`` in all. Builds the round's
        :class:`SpecDecodeMetadata`; returns the forward's int64 ``[T]`` input ids on ``device`` with the drafts that
        are only on the device scattered in, or None when every draft is on the host (``host_ids`` serve as
        they are)."""
        self.meta = SpecDecodeMetadata.build(self.proposal, logits_starts, input_starts, num_logits, device)
        if self.meta.draft_input_indices is None:
            return None
        return self.meta.scatter_drafts(to_device(host_ids, torch.int64, device))

    # --- verification ----------------------------------------------------------------------------------------
    def verify(self, logits: torch.Tensor, out: StepOutput) -> None:
        """Queue the round's verification on ``logits`` (fp32 ``[R, V]``, every row of the step); its tokens come
        back with the step's host read (``out``). Token or block verification for chains (``verify_method``)."""
        sampling = self.sampling_metadata(logits.device)
        self._pending = verify_round(logits, self.meta, sampling, out, method=self.verify_method)

    def read(self) -> VerifyResult:
        """The round's tokens per request, after the step's host read (``FloatingPointError`` for NaN/inf rows,
        naming the requests)."""
        self.result = self._pending.result([r.request_id for r in self.requests])
        return self.result

    def sampling_metadata(self, device: torch.device) -> SamplingMetadata:
        """One row per window row: request b's settings and seed; the position of the row's token (the first
        draft's position + its depth); and, for requests with penalties, the context of the row - output + the
        drafts before it (a tree: the path to the row's node)."""
        meta = self.meta
        params, seeds, positions, contexts = [], [], [], []
        for b, request in enumerate(self.requests):
            k = meta.num_draft_tokens[b]
            tree = meta.trees[b] if meta.trees is not None else None
            depths = tree.depths if tree is not None else range(k + 1)
            params += [request.params] * (k + 1)
            seeds += [request.seed] * (k + 1)
            positions += [request.num_tokens + d for d in depths]
            if not request.params.has_penalties:
                contexts += [None] * (k + 1)
                continue
            if tree is not None:
                contexts += [request.penalty_counts(tree.path_tokens(i)) for i in range(k + 1)]
                continue
            drafts = meta.draft_token_ids_host
            if drafts is None:  # a draft model reads its drafts every step when a request has penalties
                raise RuntimeError("penalties need the drafts on the host, but the proposer left them on the device")
            contexts += [request.penalty_counts(drafts[b][:j]) for j in range(k + 1)]
        return SamplingMetadata.build(params, seeds, positions, contexts, self.vocab_size, device)

    # --- after the read --------------------------------------------------------------------------------------
    def kept_rows(self, b: int) -> list[int]:
        """Rows of window b (0 = its root) whose tokens the request keeps: the root and the accepted path (a chain's
        first rows, a tree's accepted nodes)."""
        result = self.result
        if result.accepted_nodes is not None:
            return [0, *result.accepted_nodes[b]]
        return list(range(1 + result.num_accepted[b]))


def _select(proposal: DraftProposal, keep: list[int]) -> DraftProposal:
    """The proposal restricted to requests ``keep`` (those that drafted at least one token; the q rows of the
    others are empty for chains, so chain ``probs`` need no slicing)."""
    counts = proposal.counts()
    if len(keep) == len(counts):
        return proposal
    trees = [proposal.trees[i] for i in keep] if proposal.trees is not None else None
    probs = proposal.probs
    if trees is not None and probs is not None:  # tree q rows are per node, roots included: select them
        starts = [0]
        for t in proposal.trees:
            starts.append(starts[-1] + len(t.token_ids))
        rows = [r for i in keep for r in range(starts[i], starts[i + 1])]
        probs = probs.index_select(0, to_device(rows, torch.int64, probs.device))
    device_ids, bad_rows = proposal.device_ids, proposal.bad_rows
    if device_ids is not None:  # the drafts' flat rows of the kept requests
        starts = [0]
        for n in counts:
            starts.append(starts[-1] + n)
        index = to_device([r for i in keep for r in range(starts[i], starts[i + 1])], torch.int64,
                          device_ids.device)
        device_ids = device_ids.index_select(0, index)
        bad_rows = bad_rows.index_select(0, index) if bad_rows is not None else None
    host = [proposal.token_ids[i] for i in keep] if proposal.token_ids is not None else None
    return DraftProposal(host, probs, [proposal.is_onehot[i] for i in keep], None, trees, device_ids, bad_rows,
                         [counts[i] for i in keep])
