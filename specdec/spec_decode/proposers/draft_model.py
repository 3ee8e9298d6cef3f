"""A smaller model drafts k tokens autoregressively, batched over every speculating request.

The draft has its own paged KV pool whose blocks are allocated and freed in lockstep with the target's (the
scheduler reserves both through ``block_managers``). Its cache is filled lazily and caught up in one ragged
prefill fused into the first draft step: whatever tokens it lacks (the prompt on first use; the last draft and
the bonus token after an all-accepted round; tokens from plain steps) are fed before it drafts. Invariant when
drafting starts: the draft's KV covers exactly the tokens the target's covers, plus the catch-up it is fed in
that same forward.

A draft vocabulary smaller than the target's (Qwen2.5-7B+ targets have 152064 ids, their 0.5B-3B drafts 151936):
the draft never sees an id it does not have. Such ids in the context are fed to it as ``UNKNOWN_ID_STANDIN``
and left out of its penalty context; its q is zero on them, so it never proposes them, and verification (which
uses exactly that q) stays lossless - the target still emits them through the correction or bonus token.

A reduced draft vocabulary (``SpeculativeConfig(draft_vocab=)``, proposers/draft_vocab.py) goes further: the draft's
LM head keeps the rows of a subset S of target ids only, so its logits are ``[N, |S|]``. Drafts are sampled over
those columns (penalty contexts mapped onto them) and mapped back to target ids on the device; q is scattered over
the target's vocabulary, exactly 0 outside S. The draft is still fed every id it has (its embedding is whole).
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable

import torch

from specdec.cache.block_manager import BlockManager
from specdec.cache.kv_pool import KVPool
from specdec.device import to_device
from specdec.kernels.philox import STREAM_DRAFT
from specdec.model.config import ModelConfig
from specdec.model.llama import LlamaForCausalLM
from specdec.runner.cuda_graphs import DEFAULT_BATCH_BUCKETS, reserve_scratch_block
from specdec.runner.draft_loop import DraftLoopRunner, LoopOutput
from specdec.runner.model_runner import ForwardItem, ModelRunner
from specdec.sampling.metadata import SamplingMetadata
from specdec.spec_decode.forward_timer import ForwardTimer
from specdec.spec_decode.proposers.base import DraftProposal
from specdec.spec_decode.proposers.chain_drafting import draft_chains, sample_draft_step
from specdec.spec_decode.proposers.draft_vocab import DraftVocab
from specdec.spec_decode.proposers.tree_drafting import TreeShape, propose_tree
from specdec.spec_decode.request import RequestView

logger = logging.getLogger(__name__)
UNKNOWN_ID_STANDIN = 0  # what the draft is fed in place of a target id beyond its vocabulary


class DraftModelProposer:
    """A draft model with its own paged KV pool: drafts chains (``propose``) and trees (``propose_tree``).

    Everything about its cache is its own: the pool and block manager, the valid length per request
    (``kv_len``), where a tree's fed nodes sit (``tree_positions``), rollback and compaction. Built by
    ``proposers/factory.py``.

    Args:
        model: the draft model, loaded on ``device``.
        config: its config (vocabulary <= the target's, ``proposers/compat.py``).
        num_blocks, block_size, dtype: its KV pool (the same block count and size as the target's).
        target_vocab_size: q rows are laid out over the target's vocabulary (zero beyond the draft's).
        max_positions: the highest position it may write + 1 (its position embeddings, capped by max_model_len).
        tree_shape: how ``propose_tree`` grows trees (None: chains as trees).
        noise_per_round: key draft j's noise by (round start, j) instead of its position - block verification
            looks at drafts beyond those it emits, so the next round must not redraw them with the same noise
            (kernels/block_verify.py).
        timer, on_forward: adaptive k's draft timings (``on_forward(batch_size, seconds)`` per pure draft step);
            None when adaptive k is off (nothing is timed).
        pool: the draft's KV pool of ``num_blocks`` blocks, when the caller built it (a tensor-parallel draft's:
            this rank's heads, compactions broadcast to the other ranks); None: a new ``KVPool``.
        draft_vocab: the map of a reduced draft vocabulary - ``model``'s LM head then covers its ids only
            (specdec/model/subset_head.py); None: the head covers the draft's whole vocabulary.
    """

    def __init__(self, model: LlamaForCausalLM, config: ModelConfig, num_blocks: int, block_size: int,
                 dtype: torch.dtype, device: torch.device, target_vocab_size: int, max_positions: int,
                 tree_shape: TreeShape | None = None, noise_per_round: bool = False,
                 timer: ForwardTimer | None = None, on_forward: Callable[[int, float], None] | None = None,
                 pool: KVPool | None = None, draft_vocab: DraftVocab | None = None):
        self.config = config
        self.block_manager = BlockManager(num_blocks, block_size)
        pool = pool if pool is not None else KVPool(config, num_blocks, block_size, dtype, device)
        self.runner = ModelRunner(model, pool, self.block_manager, device)
        self.target_vocab_size = target_vocab_size
        self.vocab_size = config.vocab_size  # <= target_vocab_size (proposers/compat.py)
        self.draft_vocab = draft_vocab  # logits columns -> target ids (None: column c is id c)
        self.loop: DraftLoopRunner | None = None  # the pure steps of chain rounds as one program (enable_draft_loop)
        self.max_positions = max_positions
        self.tree_shape = tree_shape
        self.noise_per_round = noise_per_round
        self.timer = timer
        self.on_forward = on_forward
        self.kv_len: dict[int, int] = {}  # seq id -> tokens whose K/V are valid in the draft cache
        # seq id -> {tree node (DFS index) -> its position in the draft cache}, for the nodes fed this round
        self.tree_positions: dict[int, dict[int, int]] = {}

    @property
    def block_managers(self) -> list[BlockManager]:
        return [self.block_manager]

    @property
    def draft_model(self) -> DraftModelProposer:
        """Itself (``Proposer.draft_model``)."""
        return self

    aux_hidden_layers = None  # it reads none of the target's hidden states
    candidate_width = None  # it reads none of the target's top-k ids

    def take_candidates(self, seq_ids: list[int], tokens: list[int], candidates: list[list[int]]) -> None:
        pass  # never called (``candidate_width`` is None)

    def take_hidden_states(self, seq_ids: list[int], starts: list[int], counts: list[int],
                           hidden: torch.Tensor) -> None:
        pass  # never called: it reads none (``aux_hidden_layers`` is None)

    # --- drafting -------------------------------------------------------------------------------------------
    def propose_tree(self, seqs: list[RequestView], max_depths: list[int], max_nodes: list[int]) -> DraftProposal:
        """A draft tree per request (depth <= ``max_depths[i]``, at most ``max_nodes[i]`` drafted nodes), grown by
        ``tree_shape``; see specdec/spec_decode/proposers/tree_drafting.py."""
        shape = self.tree_shape or TreeShape([1] * max(max_depths, default=0), 1)  # no shape: chains as trees
        return propose_tree(self, seqs, max_depths, max_nodes, shape)

    def propose(self, seqs: list[RequestView], num_tokens: list[int]) -> DraftProposal:
        """Draft ``num_tokens[i]`` tokens for ``seqs[i]``, batched: k steps, each one forward over the requests
        still drafting (``chain_drafting.draft_chains``)."""
        return draft_chains(self, seqs, num_tokens)

    def chain_step(self, seqs: list[RequestView], active: list[int], step: int, input_ids: torch.Tensor | None,
                   kept: torch.Tensor | None) -> torch.Tensor:
        """One draft forward of a chain round over the requests ``active`` (indices into ``seqs``): step 0
        feeds everything the draft cache lacks (lazy prefill / catch-up) up to the last token, a later step the
        previous step's drafts (``input_ids``, on the device; ``kept``: unused here, see :func:`draft_chains`).
        Logits ``[len(active), V_draft]`` (``[len(active), |S|]`` with a reduced draft vocabulary)."""
        if step == 0:
            items = self._catch_up_items([seqs[i] for i in active])
        else:  # the ids themselves come from input_ids
            items = [ForwardItem(seqs[i].seq_id, [UNKNOWN_ID_STANDIN], seqs[i].num_tokens + step - 1, 1)
                     for i in active]
        # step 0 includes catch-up: only pure draft steps are timed (for adaptive k; no host sync)
        timed = self.timer is not None and step > 0
        start = self.timer.start(self.runner.device) if timed else None
        logits = self.runner.forward(items, input_ids=input_ids)  # (len(items), V_draft)
        if timed:
            self.timer.stop(start, functools.partial(self.on_forward, len(items)))
        for i in active:
            self.kv_len[seqs[i].seq_id] = seqs[i].num_tokens + step
        return logits

    def enable_draft_loop(self, mode: str, max_seq_len: int, max_batch: int, max_steps: int) -> None:
        """Run the pure steps (1 .. k-1) of chain rounds as one program per bucket (specdec/runner/draft_loop.py):
        a CUDA graph (``mode="cuda_graph"``) or the same program eagerly (``"eager"``: CPU tests). Uses the padding
        block of the draft's static forward (taken here when there is none yet)."""
        runner, bm = self.runner, self.block_manager
        if runner.scratch_block is None:
            runner.scratch_block = reserve_scratch_block(bm)
        buckets = tuple(b for b in DEFAULT_BATCH_BUCKETS if b < max_batch) + (max_batch,)
        self.loop = DraftLoopRunner(runner.model, runner.pool.tensors, block_size=bm.block_size,
                                    max_blocks=bm.blocks_needed(max_seq_len), scratch_block=runner.scratch_block,
                                    stream=STREAM_DRAFT, column_ids=None if self.draft_vocab is None
                                    else self.draft_vocab.target_ids, batch_sizes=buckets, max_steps=max_steps,
                                    mode=mode)  # fmt: skip

    def pure_steps(self, seqs: list[RequestView], active: list[int], input_ids: torch.Tensor,
                   steps: int) -> LoopOutput | None:
        """Steps 1 .. ``steps`` of a chain round for the requests ``active`` (each drafting ``steps + 1`` tokens;
        ``input_ids`` int64 ``[len(active)]``: step 0's drafts) through the draft loop, or None - no loop, or a round
        it does not serve (penalties, per-round noise, adaptive k's timed steps, no bucket) - and the caller runs
        them step by step. A loop that fails is turned off for good, with a warning."""
        rows = [seqs[i] for i in active]
        if (self.loop is None or self.noise_per_round or self.timer is not None
                or any(s.params.needs_host_drafts for s in rows)):
            return None
        device = self.runner.device
        bm = self.block_manager
        width = bm.blocks_needed(max(s.num_tokens for s in rows) + steps)
        table_rows = [bm.row_of(s.seq_id) for s in rows]
        tables = to_device(bm.table_array[table_rows, :width], torch.int32, device)  # [n, width]
        positions = to_device([s.num_tokens for s in rows], torch.int64, device)  # step 1's input positions
        meta = SamplingMetadata.build([s.params for s in rows], [s.seed for s in rows],
                                      [s.num_tokens + 1 for s in rows], [None] * len(rows), self.loop.width, device)
        try:
            out = self.loop.run(input_ids, positions, tables, meta, steps)
        except Exception as exc:  # noqa: BLE001 - the optional fast path falls back to the step-by-step loop
            logger.warning("draft loop (%s) failed, drafting step by step from now on: %r", self.loop.mode, exc)
            self.loop = None
            return None
        if out is not None:
            self.runner.num_forwards += steps  # one forward per pure step, as the step-by-step loop counts them
            for s in rows:
                self.kv_len[s.seq_id] = s.num_tokens + steps
        return out

    def _catch_up_items(self, seqs: list[RequestView]) -> list[ForwardItem]:
        """Per request, what the draft cache lacks, ending with its last token (whose logits are wanted)."""
        items = []
        for seq in seqs:
            have = self.kv_len.get(seq.seq_id, 0)
            items.append(ForwardItem(seq.seq_id, self.in_vocab(seq.all_token_ids[have:]), have, 1))
        return items

    # the forwards of a tree round (tree_drafting.propose_tree)
    def tree_root_position(self, seq: RequestView) -> int:
        """Where the tree's root (the last token) sits in the draft cache; its nodes follow it."""
        return seq.num_tokens - 1

    def tree_root_forward(self, seqs: list[RequestView]) -> torch.Tensor:
        """The catch-up forward of a tree round: logits ``[len(seqs), V_draft]`` at each root."""
        logits = self.runner.forward(self._catch_up_items(seqs))
        for seq in seqs:
            self.kv_len[seq.seq_id] = seq.num_tokens
        return logits

    def tree_level_forward(self, items: list[ForwardItem], parent_rows: list[int]) -> torch.Tensor:
        """One depth of tree nodes (``items``, one per request); logits per node. ``parent_rows``: each node's
        parent's row in the previous tree forward (unused: a draft model is fed tokens only)."""
        return self.runner.forward(items)

    def in_vocab(self, ids: list[int]) -> list[int]:
        """``ids`` as the draft may see them: ids beyond its vocabulary replaced by ``UNKNOWN_ID_STANDIN``."""
        if self.vocab_size >= self.target_vocab_size:
            return ids
        return [t if t < self.vocab_size else UNKNOWN_ID_STANDIN for t in ids]

    def sample_step(self, logits: torch.Tensor, seqs: list[RequestView], step: int, drafts: list[list[int]] | None,
                    bad_rows: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Draft step ``step``'s tokens from ``logits`` (``chain_drafting.sample_draft_step``)."""
        return sample_draft_step(logits, seqs, step, drafts, bad_rows, self.noise_per_round, self.draft_vocab)

    # --- the cache after verification -----------------------------------------------------------------------
    def move_accepted_path(self, request: RequestView, accepted_nodes: list[int]) -> None:
        """At the commit of a tree round, before ``num_computed`` advances: move the accepted path's fed nodes (they
        sit level by level after the root, ``request.num_computed``) to ``root + 1 ..`` in the draft cache with one
        ``KVPool.compact``, and let the valid length cover them. Only the path's fed prefix moves (a fed node's
        ancestors are fed); the rest - its last node when that is a leaf at the depth cap, and the bonus token - is
        left to the next catch-up."""
        fed = self.tree_positions.pop(request.seq_id, None)
        if not fed:
            return
        root = request.num_computed
        src, dst, kept = [], [], 0
        for depth, node in enumerate(accepted_nodes, start=1):
            if node not in fed:
                break
            if fed[node] != root + depth:
                src.append(self.block_manager.slot(request.seq_id, fed[node]))
                dst.append(self.block_manager.slot(request.seq_id, root + depth))
            kept = depth
        self.kv_len[request.seq_id] = root + 1 + kept
        if src:
            device = self.runner.device
            self.runner.pool.compact(to_device(src, torch.int64, device), to_device(dst, torch.int64, device))

    def rollback(self, request: RequestView, kv_len: int) -> None:
        """A round was committed keeping ``kv_len`` tokens: the valid length is capped there and whole blocks
        beyond it go back to the pool."""
        self.discard(request, kv_len)
        self.block_manager.truncate_to(request.seq_id, kv_len)

    def discard(self, request: RequestView, kv_len: int) -> None:
        """Forget draft state beyond ``kv_len`` (a step that failed: its blocks stay reserved for a retry)."""
        if request.seq_id in self.kv_len:
            self.kv_len[request.seq_id] = min(self.kv_len[request.seq_id], kv_len)
        # a tree's node positions are valid only within the step that drafted it (a retried or failed step
        # must never compact stale ones into the cache)
        self.tree_positions.pop(request.seq_id, None)

    def free(self, seq_id: int, finished: bool) -> None:
        self.kv_len.pop(seq_id, None)
        self.tree_positions.pop(seq_id, None)
