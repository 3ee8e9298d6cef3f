"""Verification: standardize the target's p at every draft position, then accept/reject + residual + bonus.

The accept/reject itself is one op (``ops.spec_sample``: the fused Triton kernel on CUDA, its torch reference
on CPU). This module builds its inputs: p with the same transform and per-position penalty context that
produced q, the raw-logit argmax for greedy rows, and the flattened draft layout.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch

from specdec import ops
from specdec.drafters.base import DraftProposal
from specdec.drafters.tree import DraftTree
from specdec.engine.sequence import Sequence
from specdec.sampling.penalties import penalty_context
from specdec.sampling.sampler import greedy, nonfinite_rows, read_checked
from specdec.sampling.standardize import SamplingTensors, apply_penalties, standardize_unchecked


@dataclass
class VerifyResult:
    emitted: list[list[int]]  # per request: accepted drafts, then the correction or bonus token
    num_accepted: list[int]


def verify(logits: torch.Tensor, seqs: list[Sequence], proposal: DraftProposal, *,
           method: str = "token") -> VerifyResult:
    """Accept/reject the drafts of ``seqs``.

    Args:
        logits: fp32 ``[sum(k_b + 1), V]`` target logits; request b owns k_b + 1 consecutive rows (p at each draft
            position, then the bonus position).
        proposal: the drafts and their q.
        method: "token" (``ops.spec_sample``) or "block" (``ops.block_verify``: block verification of sampled
            rows with a real q; greedy and one-hot rows token-wise); ``SpeculativeConfig.verify``.
    """
    device = logits.device
    drafts = proposal.token_ids
    # One row per verification position; row j of request b is conditioned on output + drafts[:j].
    st, logits, target_argmax = _penalised_target(
        logits,
        [s for s, d in zip(seqs, drafts) for _ in range(len(d) + 1)],
        (d[:j] for d in drafts for j in range(len(d) + 1)),
    )
    if st.all_greedy:
        argmax = _read(target_argmax, nonfinite_rows(logits))  # the round's one host read
        return _verify_greedy(argmax, drafts)
    target_probs, bad = standardize_unchecked(logits, st)  # (R, V); bad rows checked at the read below
    cu = [0]
    for d in drafts:
        cu.append(cu[-1] + len(d))
    flat = [t for d in drafts for t in d]
    verify_op = ops.block_verify if method == "block" else ops.spec_sample  # same arguments and outputs
    out, num_accepted = verify_op(
        torch.tensor(flat, dtype=torch.int64, device=device),
        torch.tensor(cu, dtype=torch.int32, device=device),
        proposal.probs,
        target_probs,
        target_argmax,
        *_request_tensors(seqs, proposal, device),  # is_greedy, draft_is_onehot, seeds, positions
        max(len(d) for d in drafts),
    )
    width = out.shape[1]
    flat_out = _read(torch.cat([out.flatten(), num_accepted.long()]), bad)  # the round's one host read
    out = [flat_out[b * width : (b + 1) * width] for b in range(len(drafts))]
    num_accepted = flat_out[len(drafts) * width :]
    return VerifyResult([row[: n + 1] for row, n in zip(out, num_accepted)], num_accepted)


def _penalised_target(
    logits: torch.Tensor, row_seqs: list[Sequence], row_prefixes: Iterable[list[int]]
) -> tuple[SamplingTensors, torch.Tensor, torch.Tensor]:
    """The target side of a round, shared by chains and trees: verification row r belongs to ``row_seqs[r]`` and is
    conditioned on its output + ``row_prefixes[r]`` (the draft tokens before row r; consumed only when a penalty is
    on, so a lazy generator costs nothing otherwise).

    Returns ``(st, logits fp32 [R, V] with the per-row penalties applied, target_argmax int64 [R])``; the argmax is
    the one plain greedy decoding uses.
    """
    st = SamplingTensors.from_params([s.params for s in row_seqs], logits.device)
    if st.any_penalty:
        outputs = [s.output_token_ids + prefix for s, prefix in zip(row_seqs, row_prefixes, strict=True)]
        prompts = [s.prompt_token_ids for s in row_seqs]
        seen, counts = penalty_context(prompts, outputs, logits.shape[-1], logits.device)
        logits = apply_penalties(logits, seen, counts, st)
    return st, logits, greedy(logits)


def _request_tensors(
    seqs: list[Sequence], proposal: DraftProposal, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The per-request inputs of the verification ops: ``(is_greedy bool [B], draft_is_onehot bool [B],
    seeds int64 [B], positions int64 [B])``; a request's first draft sits at its ``num_tokens``."""
    return (
        torch.tensor([s.params.is_greedy for s in seqs], dtype=torch.bool, device=device),
        torch.tensor(proposal.is_onehot, dtype=torch.bool, device=device),
        torch.tensor([s.seed for s in seqs], dtype=torch.int64, device=device),
        torch.tensor([s.num_tokens for s in seqs], dtype=torch.int64, device=device),
    )


def _read(values: torch.Tensor, bad_rows: torch.Tensor) -> list[int]:
    """``values`` on the host with the NaN/inf check of the verification rows; ``FloatingPointError`` names the
    bad rows (the engine then fails the requests they belong to)."""
    values, bad = read_checked(values, bad_rows)
    if bad:
        raise FloatingPointError(f"non-finite logits (NaN or inf) in rows {bad}; refusing to decode them")
    return values


def _verify_greedy(target_argmax: list[int], drafts: list[list[int]]) -> VerifyResult:
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
    return VerifyResult(emitted, accepted)


@dataclass
class TreeVerifyResult:
    emitted: list[list[int]]  # per request: the accepted path's tokens, then the correction or bonus token
    num_accepted: list[int]
    accepted_nodes: list[list[int]]  # per request: the accepted path's node indices (depth 1..num_accepted)


def verify_trees(logits: torch.Tensor, seqs: list[Sequence], proposal: DraftProposal) -> TreeVerifyResult:
    """Accept/reject the draft trees of ``seqs`` (``proposal.trees``, nodes in DFS order).

    Args:
        logits: fp32 ``[sum(n_b + 1), V]`` target logits; request b owns n_b + 1 consecutive rows, row i = p at its
            node i (conditioned on the context and the path to node i).
        proposal: the trees and, for sampled drafts, q per node (``DraftProposal.probs``, the same row layout).
    Greedy requests follow, from the root, the child equal to the target's argmax; sampled requests run
    multi-draft recursive rejection sampling (``ops.tree_sample``). One host read.
    """
    device = logits.device
    trees = proposal.trees
    # row i of request b is conditioned on output + the path to node i
    st, logits, target_argmax = _penalised_target(
        logits,
        [s for s, t in zip(seqs, trees) for _ in t.token_ids],
        (t.path_tokens(i) for t in trees for i in range(len(t.token_ids))),
    )
    if st.all_greedy:
        argmax = _read(target_argmax, nonfinite_rows(logits))  # the round's one host read
        return _verify_trees_greedy(argmax, trees)
    target_probs, bad = standardize_unchecked(logits, st)  # (R, V)
    cu = [0]
    for t in trees:
        cu.append(cu[-1] + len(t.token_ids))
    max_depth = max(t.max_depth for t in trees)
    out, num_accepted, nodes = ops.tree_sample(
        torch.tensor([x for t in trees for x in t.token_ids], dtype=torch.int64, device=device),
        torch.tensor([p for t in trees for p in t.parents], dtype=torch.int32, device=device),
        torch.tensor(cu, dtype=torch.int32, device=device),
        proposal.probs,
        target_probs,
        target_argmax,
        *_request_tensors(seqs, proposal, device),  # is_greedy, draft_is_onehot, seeds, positions
        max_depth,
    )
    flat = _read(torch.cat([out.flatten(), num_accepted.long(), nodes.long().flatten()]), bad)  # one host read
    b_count, width = out.shape
    accepted = flat[b_count * width : b_count * width + b_count]
    node_flat = flat[b_count * width + b_count :]
    return TreeVerifyResult(
        [flat[b * width : b * width + n + 1] for b, n in enumerate(accepted)],
        accepted,
        [node_flat[b * max_depth : b * max_depth + n] for b, n in enumerate(accepted)],
    )


def _verify_trees_greedy(target_argmax: list[int], trees: list[DraftTree]) -> TreeVerifyResult:
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
    return TreeVerifyResult(emitted, accepted, paths)
