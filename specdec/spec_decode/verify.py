"""Verification: the target's p (``to_probs``) at every draft position, then accept/reject + correction + bonus.

The accept/reject itself is one op (``ops.spec_sample`` / ``ops.block_verify`` for chains, ``ops.tree_sample``
for trees: the fused Triton kernel on CUDA, its torch reference on CPU). This module queues it: p with the same
transform and per-position penalty context that produced q (``SamplingMetadata``, one row per window row), the
raw-logit argmax for greedy rows, and the round's layout (``SpecDecodeMetadata``). Nothing is read here: the
emitted tokens, the accepted counts, drafts still on the device and the NaN/inf flags of the draft and target
logits are registered in the step's :class:`~specdec.device.StepOutput`, and
:meth:`PendingVerification.result` turns them into tokens after the step's one host read.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from specdec import ops
from specdec.device import StepOutput
from specdec.sampling.metadata import SamplingMetadata
from specdec.sampling.probs import apply_penalty_rows, to_probs_unchecked
from specdec.sampling.sampler import greedy, nonfinite_rows
from specdec.spec_decode.metadata import SpecDecodeMetadata
from specdec.spec_decode.proposers.base import check_draft_rows, split_drafts
from specdec.spec_decode.tree import DraftTree


@dataclass
class VerifyResult:
    """Per verifying request (batch order)."""

    emitted: list[list[int]]  # accepted drafts, then the correction or bonus token
    num_accepted: list[int]
    drafts: list[list[int]]  # its drafts on the host (a tree: its drafted nodes' tokens, DFS order)
    accepted_nodes: list[list[int]] | None  # a tree round: the accepted path's nodes (depth 1..n); chains: None


def verify_round(logits: torch.Tensor, meta: SpecDecodeMetadata, sampling: SamplingMetadata, out: StepOutput,
           method: str = "token") -> PendingVerification:
    """Queue the verification of every window of ``meta``; its result comes with ``out``'s read.

    Args:
        logits: fp32 ``[R, V]``, the step's target logits (windows at ``meta.target_logits_indices``).
        meta: the round's layout.
        sampling: one row per window row (``N + B``): request b's settings; its seed and the position of the
            row's token; the penalty context of the row (output + the drafts before it).
        out: the step's host read.
        method: chains only - "token" (``ops.spec_sample``) or "block" (``ops.block_verify``: block verification
            of sampled rows with a real q; greedy and one-hot rows token-wise); ``SpeculativeConfig.verify``.
    """
    st = sampling.st
    window_logits = meta.verification_logits(logits)  # [N + B, V]
    if sampling.penalties is not None:
        window_logits = apply_penalty_rows(window_logits, sampling.penalties, st)
    # int64 [N + B], the argmax plain greedy decoding uses. The ops read it for greedy rows only, so a round without
    # any (every fp32 temperature > 0) gets zeros: an argmax over [N + B, V] is not vectorised on CPU (~15 ms at
    # 64 x 128256)
    target_argmax = (greedy(window_logits) if st.any_greedy else
                     torch.zeros(window_logits.shape[0], dtype=torch.int64, device=window_logits.device))
    pending = PendingVerification(meta, out)
    if meta.draft_token_ids_host is None:  # a draft model's chains: their drafts come back with the read
        pending.drafts_handle = out.add(meta.draft_token_ids)
    if meta.draft_bad_rows is not None:
        pending.draft_bad_handle = out.add(meta.draft_bad_rows)
    if st.all_greedy:  # accept while the argmax equals the draft: compared on the host, after the read
        pending.target_bad_handle = out.add(nonfinite_rows(window_logits))
        pending.argmax_handle = out.add(target_argmax)
        return pending
    target_probs, bad = to_probs_unchecked(window_logits, st)  # (N + B, V); bad rows checked after the read
    pending.target_bad_handle = out.add(bad)
    per_request = (
        st.temperature.index_select(0, meta.window_starts) == 0,  # is_greedy bool [B]
        meta.draft_is_onehot_mask,  # bool [B]
        sampling.seeds.index_select(0, meta.window_starts),  # int64 [B]
        sampling.positions.index_select(0, meta.window_starts),  # int64 [B]: the first draft's position
    )
    if meta.trees is not None:
        tokens, num_accepted, nodes = ops.tree_sample(
            meta.tree_token_ids, meta.tree_parents, meta.cu_window_rows, meta.draft_probs, target_probs,
            target_argmax, *per_request, meta.max_depth)
        pending.nodes_handle = out.add(nodes.long().flatten())
    else:
        verify_op = ops.block_verify if method == "block" else ops.spec_sample  # same arguments and outputs
        tokens, num_accepted = verify_op(
            meta.draft_token_ids, meta.cu_num_draft_tokens, meta.draft_probs, target_probs, target_argmax,
            *per_request, meta.max_num_draft_tokens)
    pending.tokens_handle = out.add(tokens.flatten())  # [B * width], -1 padded
    pending.width = tokens.shape[1]
    pending.accepted_handle = out.add(num_accepted)
    return pending


class PendingVerification:
    """A round's verification, queued on the device; :meth:`result` after the step's host read."""

    def __init__(self, meta: SpecDecodeMetadata, out: StepOutput):
        self.meta = meta
        self.out = out
        self.drafts_handle: int | None = None
        self.draft_bad_handle: int | None = None
        self.target_bad_handle: int | None = None
        self.argmax_handle: int | None = None  # all-greedy rounds
        self.tokens_handle: int | None = None  # sampled rounds: the op's output tokens [B, width]
        self.accepted_handle: int | None = None
        self.nodes_handle: int | None = None  # sampled tree rounds: accepted nodes [B, max_depth]
        self.width = 0

    def result(self, request_ids: list[str]) -> VerifyResult:
        """The round's tokens per request. ``FloatingPointError`` for drafts drawn from NaN/inf draft logits
        (naming their requests, from ``request_ids``), else for NaN/inf target rows."""
        meta, out = self.meta, self.out
        counts = meta.num_draft_tokens
        drafts = meta.draft_token_ids_host
        if drafts is None:
            drafts = split_drafts(out.get(self.drafts_handle), counts)
        if self.draft_bad_handle is not None:
            check_draft_rows(out.get(self.draft_bad_handle), counts, request_ids)
        bad = [r for r, flag in enumerate(out.get(self.target_bad_handle)) if flag]
        if bad:
            raise FloatingPointError(f"non-finite logits (NaN or inf) in rows {bad}; refusing to decode them")
        if self.argmax_handle is not None:
            argmax = out.get(self.argmax_handle)
            if meta.trees is not None:
                return _greedy_trees(argmax, meta.trees, drafts)
            return _greedy_chains(argmax, drafts)
        flat, width = out.get(self.tokens_handle), self.width
        num_accepted = out.get(self.accepted_handle)
        emitted = [flat[b * width : b * width + n + 1] for b, n in enumerate(num_accepted)]
        nodes = None
        if self.nodes_handle is not None:
            node_flat, depth = out.get(self.nodes_handle), meta.max_depth
            nodes = [node_flat[b * depth : b * depth + n] for b, n in enumerate(num_accepted)]
        return VerifyResult(emitted, num_accepted, drafts, nodes)


def _greedy_chains(target_argmax: list[int], drafts: list[list[int]]) -> VerifyResult:
    """All rows greedy: accept while the target's argmax equals the draft; emit the argmax at the first mismatch
    (or the bonus argmax). Identical to the greedy rows of ``spec_sample``, without building probabilities."""
    emitted, accepted = [], []
    row = 0
    for d in drafts:
        n = 0
        while n < len(d) and target_argmax[row + n] == d[n]:
            n += 1
        emitted.append(d[:n] + [target_argmax[row + n]])
        accepted.append(n)
        row += len(d) + 1
    return VerifyResult(emitted, accepted, drafts, None)


def _greedy_trees(target_argmax: list[int], trees: list[DraftTree], drafts: list[list[int]]) -> VerifyResult:
    """All rows greedy: from the root, follow the child whose token is the target's argmax at the current node;
    emit the argmax where no child matches (or at a leaf). There is at most one such child (siblings differ), so
    this is the longest greedy-accepted root-to-leaf path."""
    emitted, accepted, paths = [], [], []
    row = 0
    for t in trees:
        kids = t.children()
        node, path = 0, []
        while True:
            want = target_argmax[row + node]
            nxt = next((c for c in kids[node] if t.token_ids[c] == want), None)
            if nxt is None:
                break
            path.append(nxt)
            node = nxt
        emitted.append([t.token_ids[c] for c in path] + [target_argmax[row + node]])
        accepted.append(len(path))
        paths.append(path)
        row += len(t.token_ids)
    return VerifyResult(emitted, accepted, drafts, paths)
