"""SpecDecodeMetadata: one speculative round as data, built once after drafting.

Every consumer of a round - the target forward's input ids, verification (token, block, tree), KV compaction,
logprobs - reads the round's layout from this one object (vLLM v1's ``SpecDecodeMetadata``): which requests
verify, how many drafts each has, where its verification window sits in the step's logits, its drafts on the
device. The offsets are computed here once, on the host, and carried to the device in one copy
(``specdec.device.to_device``: pinned, non-blocking on CUDA); nothing downstream recomputes them or indexes a
tensor with a Python list.

Terms: request b (in batch order among the verifying requests) drafted ``k_b`` tokens - a chain's drafts, or a
tree's drafted nodes (the root, its last committed token, is not a draft). Its **verification window** is its
last committed token followed by its drafts: ``k_b + 1`` target forward rows, each with a logits row: row j is
p at draft position j (a tree: p at node j, the distribution of node j's children), the last row of a chain is
the bonus position.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from specdec.device import to_device
from specdec.spec_decode.proposers.base import DraftProposal
from specdec.spec_decode.tree import DraftTree


@dataclass
class SpecDecodeMetadata:
    """The layout of one round's verifying requests (B of them, N = sum(k_b) drafts)."""

    # --- host ---
    num_draft_tokens: list[int]  # [B] k_b >= 1 (a tree: its drafted nodes)
    draft_token_ids_host: list[list[int]] | None  # per request its drafts (a tree: DFS order), or None while
    #                                               they are on the device only (a draft model's chains)
    draft_is_onehot: list[bool]  # [B] deterministic drafts (q is a point mass: greedy or model-free)
    trees: list[DraftTree] | None  # per request its tree, or None for chains
    # --- device ---
    draft_token_ids: torch.Tensor  # int64 [N] the drafts, request-major (a tree: its drafted nodes, DFS order)
    cu_num_draft_tokens: torch.Tensor  # int32 [B + 1]
    cu_window_rows: torch.Tensor  # int32 [B + 1] = cu_num_draft_tokens + [0, 1, .., B]: windows of k_b + 1 rows
    target_logits_indices: torch.Tensor  # int64 [N + B] the step's logits rows of every window, in window order
    window_starts: torch.Tensor  # int64 [B] each window's first row among those N + B rows
    draft_input_indices: torch.Tensor | None  # int64 [N] where each draft sits in the forward's flat input ids
    #                                           (chains whose drafts are on the device only; else None)
    tree_token_ids: torch.Tensor | None  # int64 [N + B] every tree's nodes, root first, DFS order (trees only)
    tree_parents: torch.Tensor | None  # int32 [N + B] each node's parent within its tree (-1: the root)
    draft_probs: torch.Tensor | None  # fp32 q: chains [N, V], trees [N + B, V] (row per node); None if one-hot
    draft_is_onehot_mask: torch.Tensor  # bool [B]
    draft_bad_rows: torch.Tensor | None  # bool [N] drafts drawn from NaN/inf draft logits, not yet checked
    all_rows: bool  # the windows are all of the step's logits rows, in order (no plain rows beside them)

    @property
    def max_num_draft_tokens(self) -> int:
        return max(self.num_draft_tokens)

    @property
    def max_depth(self) -> int:
        """A tree round's deepest node (a chain round: its longest chain)."""
        if self.trees is None:
            return self.max_num_draft_tokens
        return max(t.max_depth for t in self.trees)

    @classmethod
    def build(cls, proposal: DraftProposal, logits_starts: list[int], input_starts: list[int], num_logits: int,
              device: torch.device) -> SpecDecodeMetadata:
        """The metadata of a round whose verifying requests drafted ``proposal`` (restricted to them, each with
        k_b >= 1). ``logits_starts[b]`` / ``input_starts[b]``: the first logits row / flat input position of
        request b's window in the step's forward; ``num_logits``: the step's logits rows in all. One copy of
        every index to ``device``."""
        counts = proposal.counts()
        num_requests = len(counts)
        host_ids = proposal.token_ids
        cu, windows, rows, draft_inputs = [0], [], [], []
        for b, (k, logits_start, input_start) in enumerate(zip(counts, logits_starts, input_starts)):
            windows.append(cu[-1] + b)
            cu.append(cu[-1] + k)
            rows += range(logits_start, logits_start + k + 1)
            draft_inputs += range(input_start + 1, input_start + 1 + k)  # after the window's last token
        trees = proposal.trees
        # one int64 vector to the device, sliced into every index below
        parts: list[list[int]] = [cu, rows, windows, [int(x) for x in proposal.is_onehot]]
        on_device_only = host_ids is None
        if on_device_only:
            parts.append(draft_inputs)
        else:
            parts.append([t for d in host_ids for t in d])
        if trees is not None:
            parts.append([t for tree in trees for t in tree.token_ids])
            parts.append([p for tree in trees for p in tree.parents])
        flat = to_device([x for part in parts for x in part], torch.int64, device)
        pieces = flat.split([len(part) for part in parts])
        cu_t, rows_t, windows_t, onehot_t, fifth = pieces[:5]
        cu_t = cu_t.int()
        return cls(
            num_draft_tokens=list(counts),
            draft_token_ids_host=host_ids,
            draft_is_onehot=list(proposal.is_onehot),
            trees=trees,
            draft_token_ids=proposal.device_ids if on_device_only else fifth,
            cu_num_draft_tokens=cu_t,
            cu_window_rows=cu_t + torch.arange(num_requests + 1, dtype=torch.int32, device=cu_t.device),
            target_logits_indices=rows_t,
            window_starts=windows_t,
            draft_input_indices=fifth if on_device_only else None,
            tree_token_ids=pieces[5] if trees is not None else None,
            tree_parents=pieces[6].int() if trees is not None else None,
            draft_probs=proposal.probs,
            draft_is_onehot_mask=onehot_t.bool(),
            draft_bad_rows=proposal.bad_rows,
            all_rows=rows == list(range(num_logits)),
        )

    def verification_logits(self, logits: torch.Tensor) -> torch.Tensor:
        """fp32 ``[N + B, V]``: the windows' rows of the step's ``logits`` (the tensor itself when they are all of
        it), gathered on the device."""
        return logits if self.all_rows else logits.index_select(0, self.target_logits_indices)

    def scatter_drafts(self, input_ids: torch.Tensor) -> torch.Tensor:
        """The target forward's flat input ids (int64 ``[T]`` on the device, placeholders where the drafts go)
        with the device-only drafts written in; unchanged when the drafts are on the host."""
        if self.draft_input_indices is not None:
            input_ids[self.draft_input_indices] = self.draft_token_ids
        return input_ids
