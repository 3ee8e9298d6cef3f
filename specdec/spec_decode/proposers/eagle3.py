"""EAGLE-3: a one-layer head fed the target's own hidden states drafts chains and trees (the head and its published
layout: specdec/model/eagle3.py).

Alignment (EAGLE's, as vLLM's proposer and SpecForge's training lay it out): the head's cache entry at position p
is computed from the target's fused hidden state at p (what the target computed reading token p) and the
embedding of token p + 1, rotated at position p; its output predicts token p + 2. For a request of n tokens whose
target KV covers n - 1 (a decode step), entries 0 .. n - 2 can be computed, and entry n - 2 (the last token's
embedding, the target's hidden state one before it) gives q of the first draft. Draft step j > 1 feeds entry
n - 3 + j: the previous draft's embedding with the head's own output hidden state of the entry before (EAGLE's
drafting). Those entries are speculative: the head's valid length (``kv_len``) stays n - 1 after a round, and the
next round's catch-up recomputes them from the target's hidden states of the tokens that were kept.

Hidden states: after every target forward the step hands over, per request, the target's hidden states of the
tokens it keeps (``take_hidden_states``; a prefill chunk: all its tokens, a verification window: the root and the
accepted path, a plain decode: its token), with their positions. They are fused (``fc``) at once and kept per
request until the next catch-up forward feeds them; rows beyond the committed KV are dropped by ``discard`` (a
failed step) and ``rollback``. A request whose hidden states do not reach back to its head cache (none yet: a
one-token prompt's first step) drafts nothing that round.

The head's KV lives in its own paged pool (one layer, ``block_managers``), allocated by the scheduler in lockstep
with the target's like a draft model's: ``kv_len``, lazy catch-up fused into the first draft step, rollback and
discard as there. A tree's nodes are fed level by level after the root entry (n - 2), each with its parent's output
hidden state, under the draft model's tree policy (``tree_drafting.propose_tree``); the accepted path needs no
move - its entries are recomputed from the target's hidden states next round.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch

from specdec.cache.block_manager import BlockManager
from specdec.cache.kv_pool import KVPool
from specdec.device import to_device
from specdec.model.eagle3 import Eagle3Head
from specdec.runner.model_runner import ForwardItem, ModelRunner
from specdec.spec_decode.forward_timer import ForwardTimer
from specdec.spec_decode.proposers.base import DraftProposal
from specdec.spec_decode.proposers.chain_drafting import draft_chains, sample_draft_step
from specdec.spec_decode.proposers.tree_drafting import TreeShape, propose_tree
from specdec.spec_decode.request import RequestView

DEVICE_TOKEN = 0  # a forward item's placeholder id for a token that is only on the device (input_ids)


class Eagle3Proposer:
    """An EAGLE-3 head with its own paged KV pool: drafts chains (``propose``) and trees (``propose_tree``) from
    the target's hidden states (``aux_hidden_layers``: which ones; ``take_hidden_states``: the hand-over).

    Args:
        head: the loaded head (``specdec.checkpoint.eagle3.load_eagle3_head``), on ``device``.
        aux_layers: the target layers whose hidden states it is fed (``Eagle3Config.aux_layers``).
        num_blocks, block_size, dtype: its KV pool (the same block count and size as the target's).
        max_positions: the highest position it may write + 1.
        tree_shape, noise_per_round, timer, on_forward: as for ``DraftModelProposer``.
    """

    def __init__(self, head: Eagle3Head, aux_layers: tuple[int, ...], num_blocks: int, block_size: int,
                 dtype: torch.dtype, device: torch.device, max_positions: int, tree_shape: TreeShape | None = None,
                 noise_per_round: bool = False, timer: ForwardTimer | None = None,
                 on_forward: Callable[[int, float], None] | None = None):
        self.head = head
        self.config = head.config.layer  # the head's layer (its pool's shape)
        self.aux_hidden_layers = aux_layers
        self.block_manager = BlockManager(num_blocks, block_size)
        pool = KVPool(self.config, num_blocks, block_size, dtype, device)
        self.runner = ModelRunner(head, pool, self.block_manager, device)  # stages the head's forwards (prepare)
        # logits and q are laid out over the target's vocabulary (Eagle3Head.to_target_vocab)
        self.target_vocab_size = self.vocab_size = self.config.vocab_size
        self.draft_vocab = None  # its logits already span the target's vocabulary (no column map to apply)
        self.max_positions = max_positions
        self.tree_shape = tree_shape
        self.noise_per_round = noise_per_round
        self.timer = timer
        self.on_forward = on_forward
        self.kv_len: dict[int, int] = {}  # seq id -> head entries computed from the target's hidden states
        # seq id -> (first position, fused hidden states [n, H]) handed over and not yet fed, in position order
        self.pending: dict[int, list[tuple[int, torch.Tensor]]] = {}
        self.tree_positions: dict[int, dict[int, int]] = {}  # as the draft model's (read by tree_drafting only)
        self._hidden: torch.Tensor | None = None  # [R, H] the head's output hidden state per row of its last forward

    @property
    def block_managers(self) -> list[BlockManager]:
        return [self.block_manager]

    draft_model = None  # a head, not a draft model (``Proposer.draft_model``)
    candidate_width = None  # it reads none of the target's top-k ids

    def take_candidates(self, seq_ids: list[int], tokens: list[int], candidates: list[list[int]]) -> None:
        pass  # never called (``candidate_width`` is None)

    # --- the target's hidden states -------------------------------------------------------------------------
    def take_hidden_states(self, seq_ids: list[int], starts: list[int], counts: list[int],
                           hidden: torch.Tensor) -> None:
        """The target's hidden states ``[sum(counts), 3 * H_target]`` (``aux_hidden_layers`` concatenated) of
        ``counts[i]`` kept tokens of request ``seq_ids[i]`` from position ``starts[i]`` on, request-major: fused
        now, fed by the request's next catch-up forward."""
        fused = self.head.fuse(hidden)  # [sum(counts), H]
        for seq_id, start, part in zip(seq_ids, starts, torch.split(fused, counts)):
            if part.shape[0]:
                self._drop_pending(seq_id, 0, start)  # a position handed over again replaces the old rows
                self.pending.setdefault(seq_id, []).append((start, part))

    def _drop_pending(self, seq_id: int, lo: int, hi: int | None = None) -> None:
        """Keep only the pending rows of positions ``[lo, hi)`` (``hi`` None: no upper bound)."""
        hi = hi if hi is not None else 1 << 62
        kept = []
        for start, rows in self.pending.get(seq_id, []):
            a, b = max(start, lo), min(start + rows.shape[0], hi)
            if a < b:
                kept.append((a, rows[a - start : b - start]))
        if kept:
            self.pending[seq_id] = kept
        else:
            self.pending.pop(seq_id, None)

    def _pending_rows(self, seq: RequestView, lo: int, hi: int) -> torch.Tensor:
        """The fused hidden states of positions ``[lo, hi)``; ``RuntimeError`` if some were never handed over."""
        parts, at = [], lo
        for start, rows in self.pending.get(seq.seq_id, []):
            end = start + rows.shape[0]
            if start <= at < end:
                parts.append(rows[at - start : min(end, hi) - start])
                at = min(end, hi)
        if at < hi:
            raise RuntimeError(f"EAGLE-3 head: the target's hidden states of positions {at}..{hi - 1} of request "
                               f"{seq.request_id} were never handed over")
        return parts[0] if len(parts) == 1 else torch.cat(parts)

    @staticmethod
    def _can_draft(seq: RequestView) -> bool:
        """The target has read a token before the last one (entry n - 2 exists); not so in a one-token prompt's
        first step."""
        return seq.num_tokens >= 2

    # --- drafting -------------------------------------------------------------------------------------------
    def propose(self, seqs: list[RequestView], num_tokens: list[int]) -> DraftProposal:
        """Draft ``num_tokens[i]`` tokens for ``seqs[i]`` (``chain_drafting.draft_chains``, with this head's
        forwards)."""
        return draft_chains(self, seqs, [k if self._can_draft(s) else 0 for s, k in zip(seqs, num_tokens)])

    def propose_tree(self, seqs: list[RequestView], max_depths: list[int], max_nodes: list[int]) -> DraftProposal:
        """A draft tree per request, grown as a draft model's (``tree_drafting.propose_tree``)."""
        shape = self.tree_shape or TreeShape([1] * max(max_depths, default=0), 1)  # no shape: chains as trees
        can = [self._can_draft(s) for s in seqs]
        return propose_tree(self, seqs, [d if c else 0 for d, c in zip(max_depths, can)],
                            [n if c else 0 for n, c in zip(max_nodes, can)], shape)

    def pure_steps(self, seqs: list[RequestView], active: list[int], input_ids: torch.Tensor, steps: int) -> None:
        """None: a head's steps feed its own hidden states back, so ``draft_chains`` runs them step by step (the
        draft model's one-program loop, ``DraftModelProposer.pure_steps``, does not apply)."""
        return None

    def chain_step(self, seqs: list[RequestView], active: list[int], step: int, input_ids: torch.Tensor | None,
                   kept: torch.Tensor | None) -> torch.Tensor:
        """One head forward of a chain round over ``active`` (indices into ``seqs``): step 0 is the catch-up
        (entries up to n - 2, from the target's hidden states); step j > 0 feeds entry n - 2 + j: the previous
        draft (``input_ids``) with the head's own hidden state of the row before (``kept``: the previous step's
        rows still drafting, None for all). Logits over the target's vocabulary ``[len(active), V]``."""
        if step == 0:
            return self._catch_up([seqs[i] for i in active])
        hidden = self._hidden if kept is None else self._hidden.index_select(0, kept)
        items = [ForwardItem(seqs[i].seq_id, [DEVICE_TOKEN], seqs[i].num_tokens - 2 + step, 1) for i in active]
        start = self.timer.start(self.runner.device) if self.timer is not None else None  # pure draft steps only
        logits = self._forward(items, hidden, input_ids)
        if start is not None:
            self.timer.stop(start, functools.partial(self.on_forward, len(items)))
        return logits

    def _catch_up(self, seqs: list[RequestView]) -> torch.Tensor:
        """Feed each request's entries from its valid length to n - 2 (at least entry n - 2: a retried step
        recomputes it) with the handed-over hidden states; logits at entry n - 2, the q of the first draft."""
        items, hidden = [], []
        for seq in seqs:
            end = seq.num_tokens - 1  # entries [start, end): tokens start + 1 .. n - 1
            start = min(self.kv_len.get(seq.seq_id, 0), end - 1)
            hidden.append(self._pending_rows(seq, start, end))
            items.append(ForwardItem(seq.seq_id, seq.all_token_ids[start + 1 : end + 1], start, 1))
        logits = self._forward(items, hidden[0] if len(hidden) == 1 else torch.cat(hidden))
        for seq in seqs:
            end = seq.num_tokens - 1
            self.kv_len[seq.seq_id] = end
            self._drop_pending(seq.seq_id, end - 1)  # entry n - 2's row stays: a retried step recomputes it
        return logits

    def tree_root_position(self, seq: RequestView) -> int:
        """The tree's root entry: n - 2 (it predicts the tokens at position n); the nodes follow it."""
        return seq.num_tokens - 2

    def tree_root_forward(self, seqs: list[RequestView]) -> torch.Tensor:
        return self._catch_up(seqs)

    def tree_level_forward(self, items: list[ForwardItem], parent_rows: list[int]) -> torch.Tensor:
        """One depth of tree nodes, each fed its parent's output hidden state (row ``parent_rows[r]`` of the
        previous forward)."""
        hidden = self._hidden.index_select(0, to_device(parent_rows, torch.int64, self._hidden.device))
        return self._forward(items, hidden)

    def _forward(self, items: list[ForwardItem], hidden: torch.Tensor,
                 input_ids: torch.Tensor | None = None) -> torch.Tensor:
        """One head forward on its pool: logits over the target's vocabulary for the items' logits rows; their
        output hidden states are kept for the next step (``_hidden``)."""
        meta, ids, positions, logits_indices = self.runner.prepare(items, with_ids=input_ids is None)
        if input_ids is not None:
            ids = input_ids
        self.runner.num_forwards += 1
        logits, self._hidden = self.head(ids, positions, hidden, self.runner.pool.tensors, meta, logits_indices)
        return self.head.to_target_vocab(logits)

    def in_vocab(self, ids: list[int]) -> list[int]:
        return ids  # the head embeds target ids

    def sample_step(self, logits: torch.Tensor, seqs: list[RequestView], step: int, drafts: list[list[int]] | None,
                    bad_rows: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor | None]:
        return sample_draft_step(logits, seqs, step, drafts, bad_rows, self.noise_per_round)

    # --- after verification ---------------------------------------------------------------------------------
    def move_accepted_path(self, request: RequestView, accepted_nodes: list[int]) -> None:
        """Nothing moves: the accepted path's entries are recomputed from the target's hidden states by the next
        catch-up (only the tree's node positions are forgotten)."""
        self.tree_positions.pop(request.seq_id, None)

    def rollback(self, request: RequestView, kv_len: int) -> None:
        """A round was committed keeping ``kv_len`` tokens: state beyond it forgotten, whole blocks beyond it
        given back."""
        self.discard(request, kv_len)
        self.block_manager.truncate_to(request.seq_id, kv_len)

    def discard(self, request: RequestView, kv_len: int) -> None:
        """Forget state beyond ``kv_len`` (the committed length): head entries and handed-over hidden states."""
        if request.seq_id in self.kv_len:
            self.kv_len[request.seq_id] = min(self.kv_len[request.seq_id], kv_len)
        self._drop_pending(request.seq_id, 0, kv_len)
        self.tree_positions.pop(request.seq_id, None)

    def free(self, seq_id: int, finished: bool) -> None:
        self.kv_len.pop(seq_id, None)
        self.pending.pop(seq_id, None)
        self.tree_positions.pop(seq_id, None)
