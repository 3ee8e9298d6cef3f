"""Verification: standardize the target's p at every draft position, then accept/reject + residual + bonus.

The accept/reject itself is one op (``ops.spec_sample``: the fused Triton kernel on CUDA, its torch reference
on CPU). This module builds its inputs: p with the same transform and per-position penalty context that
produced q, the raw-logit argmax for greedy rows, and the flattened draft layout. The drafts may still be on the
device (a draft model's chains): a round makes one host read, which brings back the result, the drafts and the
NaN/inf flags of the draft and the target logits together. Requests are read through :class:`VerifyRequest`
(``engine.sequence.Sequence`` is one), never the engine's own type.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Protocol

import torch

from specdec import ops
from specdec.device import to_device
from specdec.drafters.base import DraftProposal, check_draft_rows, split_drafts
from specdec.drafters.tree import DraftTree
from specdec.sampling.params import SamplingParams
from specdec.sampling.penalties import penalty_rows
from specdec.sampling.sampler import greedy, nonfinite_rows
from specdec.sampling.standardize import SamplingTensors, apply_penalty_rows, standardize_unchecked


class VerifyRequest(Protocol):
    """What verification reads of a request."""

    request_id: str
    params: SamplingParams
    seed: int  # the request's randomness key
    prompt_token_ids: list[int]  # the penalty context, with output_token_ids
    output_token_ids: list[int]

    @property
    def num_tokens(self) -> int: ...  # len(prompt) + len(output): the position of the first draft


@dataclass
class VerifyResult:
    emitted: list[list[int]]  # per request: accepted drafts, then the correction or bonus token
    num_accepted: list[int]
    drafts: list[list[int]]  # per request: its drafts, on the host
    read_with: list[int] = field(default_factory=list)  # the host copy of the ``read_with`` argument


def verify(logits: torch.Tensor, seqs: list[VerifyRequest], proposal: DraftProposal, *,
           method: str = "token", read_with: torch.Tensor | None = None) -> VerifyResult:
    """Accept/reject the drafts of ``seqs`` in one host read (a second, before it, only when a penalty needs
    drafts that are still on the device - a draft model reads them for such requests itself).

    Args:
        logits: fp32 ``[sum(k_b + 1), V]`` target logits; request b owns k_b + 1 consecutive rows (p at each draft
            position, then the bonus position).
        proposal: the drafts (on the host or the device) and their q.
        method: "token" (``ops.spec_sample``) or "block" (``ops.block_verify``: block verification of sampled
            rows with a real q; greedy and one-hot rows token-wise); ``SpeculativeConfig.verify``.
        read_with: int64 ``[M]`` on the device, more values for the same host read (the step's plain rows), or
            None; returned as ``VerifyResult.read_with``.
    Raises ``FloatingPointError`` for drafts drawn from NaN/inf draft logits (naming their requests), else for
    NaN/inf target rows.
    """
    device = logits.device
    counts = proposal.counts()
    # One row per verification position; row j of request b is conditioned on output + drafts[:j].
    st, logits, target_argmax = _penalised_target(
        logits,
        [s for s, k in zip(seqs, counts) for _ in range(k + 1)],
        lambda: (d[:j] for d in proposal.read_token_ids([s.request_id for s in seqs]) for j in range(len(d) + 1)),
    )
    if st.all_greedy:  # accept while the argmax equals the draft: compared on the host, after the one read
        argmax, drafts, extra = _read_round([target_argmax], nonfinite_rows(logits), seqs, proposal, read_with)
        return _verify_greedy(argmax, drafts, extra)
    target_probs, bad = standardize_unchecked(logits, st)  # (R, V); bad rows checked at the read below
    cu = [0]
    for k in counts:
        cu.append(cu[-1] + k)
    verify_op = ops.block_verify if method == "block" else ops.spec_sample  # same arguments and outputs
    out, num_accepted = verify_op(
        proposal.device_token_ids(device),  # int64 [sum(k_b)]
        to_device(cu, torch.int32, device),
        proposal.probs,
        target_probs,
        target_argmax,
        *_request_tensors(seqs, proposal, device),  # is_greedy, draft_is_onehot, seeds, positions
        max(counts),
    )
    flat_out, drafts, extra = _read_round([out.flatten(), num_accepted.long()], bad, seqs, proposal, read_with)
    width = out.shape[1]
    rows = [flat_out[b * width : (b + 1) * width] for b in range(len(counts))]
    num_accepted = flat_out[len(counts) * width :]
    return VerifyResult([row[: n + 1] for row, n in zip(rows, num_accepted)], num_accepted, drafts, extra)


def _read_round(values: list[torch.Tensor], target_bad: torch.Tensor, seqs: list[VerifyRequest],
                proposal: DraftProposal, read_with: torch.Tensor | None
                ) -> tuple[list[int], list[list[int]], list[int]]:
    """The round's one host read: ``values`` (int64 tensors, concatenated) and ``read_with``, the drafts if they
    are still on the device, the drafts' NaN/inf flags if not yet checked, and the target rows' flags
    (``target_bad`` bool ``[R]``). Returns ``(values, drafts per request, read_with)``; ``FloatingPointError`` for
    a flagged draft (naming its requests), then for a flagged target row."""
    counts = proposal.counts()
    if read_with is not None:
        values = [*values, read_with]
    parts = list(values)
    on_device = proposal.token_ids is None
    if on_device:
        parts.append(proposal.device_ids)
    if proposal.bad_rows is not None:
        parts.append(proposal.bad_rows.long())
    parts.append(target_bad.long())
    flat = torch.cat(parts).tolist()  # the round's one host read
    n_values, n_drafts = sum(v.shape[0] for v in values), sum(counts)
    n_with = read_with.shape[0] if read_with is not None else 0
    out, extra, rest = flat[: n_values - n_with], flat[n_values - n_with : n_values], flat[n_values:]
    if on_device:
        proposal.token_ids, rest = split_drafts(rest[:n_drafts], counts), rest[n_drafts:]
    if proposal.bad_rows is not None:
        check_draft_rows(rest[:n_drafts], counts, [s.request_id for s in seqs])
        proposal.bad_rows, rest = None, rest[n_drafts:]
    bad = [r for r, flag in enumerate(rest) if flag]
    if bad:
        raise FloatingPointError(f"non-finite logits (NaN or inf) in rows {bad}; refusing to decode them")
    return out, proposal.token_ids, extra


def _penalised_target(
    logits: torch.Tensor, row_seqs: list[VerifyRequest], row_prefixes: Callable[[], Iterable[list[int]]]
) -> tuple[SamplingTensors, torch.Tensor, torch.Tensor]:
    """The target side of a round, shared by chains and trees: verification row r belongs to ``row_seqs[r]`` and is
    conditioned on its output + ``row_prefixes()[r]`` (the draft tokens before row r; called only when a penalty
    is on, so it costs nothing otherwise).

    Returns ``(st, logits fp32 [R, V] with the per-row penalties applied, target_argmax int64 [R])``; the argmax is
    the one plain greedy decoding uses. The ops read it only for greedy rows, so a batch without any (every fp32
    temperature > 0) gets zeros instead: an argmax over [R, V] is not vectorised on CPU (~15 ms at 64 x 128256).
    """
    st = SamplingTensors.from_params([s.params for s in row_seqs], logits.device)
    if st.any_penalty:
        outputs = [s.output_token_ids + prefix for s, prefix in zip(row_seqs, row_prefixes(), strict=True)]
        prompts = [s.prompt_token_ids for s in row_seqs]
        active = [s.params.has_penalties for s in row_seqs]
        rows = penalty_rows(prompts, outputs, logits.shape[-1], logits.device, active)
        logits = apply_penalty_rows(logits, rows, st)
    if not st.any_greedy:
        return st, logits, torch.zeros(logits.shape[0], dtype=torch.int64, device=logits.device)
    return st, logits, greedy(logits)


def _request_tensors(
    seqs: list[VerifyRequest], proposal: DraftProposal, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The per-request inputs of the verification ops: ``(is_greedy bool [B], draft_is_onehot bool [B],
    seeds int64 [B], positions int64 [B])``; a request's first draft sits at its ``num_tokens``."""
    return (
        to_device([s.params.is_greedy for s in seqs], torch.bool, device),
        to_device(proposal.is_onehot, torch.bool, device),
        to_device([s.seed for s in seqs], torch.int64, device),
        to_device([s.num_tokens for s in seqs], torch.int64, device),
    )


def _verify_greedy(target_argmax: list[int], drafts: list[list[int]], read_with: list[int]) -> VerifyResult:
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
    return VerifyResult(emitted, accepted, drafts, read_with)


@dataclass
class TreeVerifyResult:
    emitted: list[list[int]]  # per request: the accepted path's tokens, then the correction or bonus token
    num_accepted: list[int]
    accepted_nodes: list[list[int]]  # per request: the accepted path's node indices (depth 1..num_accepted)
    read_with: list[int] = field(default_factory=list)  # the host copy of the ``read_with`` argument


def verify_trees(logits: torch.Tensor, seqs: list[VerifyRequest], proposal: DraftProposal, *,
                 read_with: torch.Tensor | None = None) -> TreeVerifyResult:
    """Accept/reject the draft trees of ``seqs`` (``proposal.trees``, nodes in DFS order).

    Args:
        logits: fp32 ``[sum(n_b + 1), V]`` target logits; request b owns n_b + 1 consecutive rows, row i = p at its
            node i (conditioned on the context and the path to node i).
        proposal: the trees and, for sampled drafts, q per node (``DraftProposal.probs``, the same row layout).
        read_with: as in :func:`verify`.
    Greedy requests follow, from the root, the child equal to the target's argmax; sampled requests run
    multi-draft recursive rejection sampling (``ops.tree_sample``). One host read.
    """
    device = logits.device
    trees = proposal.trees
    # row i of request b is conditioned on output + the path to node i
    st, logits, target_argmax = _penalised_target(
        logits,
        [s for s, t in zip(seqs, trees) for _ in t.token_ids],
        lambda: (t.path_tokens(i) for t in trees for i in range(len(t.token_ids))),
    )
    if st.all_greedy:
        argmax, _, extra = _read_round([target_argmax], nonfinite_rows(logits), seqs, proposal, read_with)
        return _verify_trees_greedy(argmax, trees, extra)
    target_probs, bad = standardize_unchecked(logits, st)  # (R, V)
    cu = [0]
    for t in trees:
        cu.append(cu[-1] + len(t.token_ids))
    max_depth = max(t.max_depth for t in trees)
    out, num_accepted, nodes = ops.tree_sample(
        to_device([x for t in trees for x in t.token_ids], torch.int64, device),
        to_device([p for t in trees for p in t.parents], torch.int32, device),
        to_device(cu, torch.int32, device),
        proposal.probs,
        target_probs,
        target_argmax,
        *_request_tensors(seqs, proposal, device),  # is_greedy, draft_is_onehot, seeds, positions
        max_depth,
    )
    flat, _, extra = _read_round([out.flatten(), num_accepted.long(), nodes.long().flatten()], bad, seqs, proposal,
                                 read_with)
    b_count, width = out.shape
    accepted = flat[b_count * width : b_count * width + b_count]
    node_flat = flat[b_count * width + b_count :]
    return TreeVerifyResult(
        [flat[b * width : b * width + n + 1] for b, n in enumerate(accepted)],
        accepted,
        [node_flat[b * max_depth : b * max_depth + n] for b, n in enumerate(accepted)],
        extra,
    )


def _verify_trees_greedy(target_argmax: list[int], trees: list[DraftTree], read_with: list[int]
                         ) -> TreeVerifyResult:
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
    return TreeVerifyResult(emitted, accepted, paths, read_with)
