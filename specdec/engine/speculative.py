"""The speculative half of a step: drafting, verification and the commit of a round (rollback, metrics).

``engine/step.py`` runs the step: requests that do not speculate (prefill chunks, ``k_eff <= 0``, a model-free
drafter with no match) ride in the same target forward as plain rows, with no verification overhead. Stop
conditions are checked at commit, on accepted tokens only (``LLMEngine._process``). A draft model's chain drafts
stay on the device from the draft loop through the target forward (:func:`target_input_ids`) to verification,
whose one host read brings them back with the result (docs/architecture.md, "Host reads").
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from specdec import ops
from specdec.cache.block_manager import BlockManager
from specdec.cache.kv_compaction import compaction_slots
from specdec.cache.kv_pool import KVPool
from specdec.config import EngineConfig, SpeculativeConfig, eos_ids
from specdec.device import to_device
from specdec.drafters.base import DraftProposal
from specdec.drafters.combined import CombinedDrafter
from specdec.drafters.compat import check_draft_compatible
from specdec.drafters.draft_model import DraftModelDrafter
from specdec.drafters.draft_tree import TreeShape
from specdec.drafters.ngram import NgramDrafter
from specdec.drafters.prompt_lookup import PromptLookupDrafter
from specdec.drafters.tree import DraftTree
from specdec.engine.adaptive import AdaptiveK, ForwardTimer, MeasuredCostModel
from specdec.engine.model_runner import ForwardItem
from specdec.engine.scheduler import ScheduledBatch
from specdec.engine.sequence import Sequence
from specdec.model.config import ModelConfig, resolve_dtype
from specdec.model.loader import load_model, resolve_model_path
from specdec.model.tokenizer import Tokenizer
from specdec.sampling.verify import verify, verify_trees


class SpeculativeDecoder:
    def __init__(self, config: EngineConfig, spec: SpeculativeConfig, tokenizer: Tokenizer | None):
        self.config = config
        self.spec = spec
        self.k = spec.num_speculative_tokens
        self.block_manager: BlockManager | None = None  # the draft model's pool, in lockstep with the target's
        self.draft_max_positions = config.max_model_len
        self.stats = {"rollback_freed_blocks": 0}  # engine-wide counters (tests assert page-boundary rollbacks)
        model_drafter = self._load_draft_model(tokenizer) if spec.uses_draft_model else None
        lookup = (PromptLookupDrafter(spec.prompt_lookup_min, spec.prompt_lookup_max)
                  if spec.method == "prompt_lookup" or (spec.method == "combined" and
                                                        spec.combined_lookup == "prompt_lookup")
                  else NgramDrafter(spec.ngram_min_order, spec.ngram_max_order, spec.ngram_window))
        self._model_drafter = model_drafter
        if spec.method == "draft_model":
            self.drafter = model_drafter
        elif spec.method == "combined":
            self.drafter = CombinedDrafter(lookup, model_drafter)
        else:
            self.drafter = lookup
        self.cost_model = spec.cost_model or MeasuredCostModel(is_model_free=not spec.uses_draft_model)
        self.adaptive = AdaptiveK(self.k, self.cost_model) if spec.adaptive else None
        self.timer = ForwardTimer() if self.adaptive is not None else None  # forwards are timed for adaptive k only
        if model_drafter is not None and self.timer is not None:
            model_drafter.timer = self.timer
            model_drafter.on_forward = self.cost_model.observe_draft
        if model_drafter is not None:
            model_drafter.noise_per_round = spec.verify == "block"  # fresh drafts every round (block_verify.py)
        self.batch_size = 1  # running requests, refreshed every step (adaptive k is chosen per batch size)
        if model_drafter is not None and spec.uses_tree:
            model_drafter.tree_shape = TreeShape(spec.tree if isinstance(spec.tree, list) else None,
                                                 spec.tree_max_branch)
        self.target_pool = None  # the target's KVPool, set by the engine (tree rounds compact it)

    def _load_draft_model(self, tokenizer: Tokenizer | None) -> DraftModelDrafter:
        config, spec = self.config, self.spec
        path = resolve_model_path(spec.draft_model)
        draft_config = ModelConfig.from_json(path)
        check_draft_compatible(config.model_config, draft_config, tokenizer, Tokenizer.from_dir(path),
                               config.eos_token_ids, eos_ids(path, draft_config))
        dtype = resolve_dtype(spec.draft_dtype, draft_config, config.device) if spec.draft_dtype else config.dtype
        # the draft writes positions up to max_model_len - 1 at most, like the target
        self.draft_max_positions = min(draft_config.max_position_embeddings, config.max_model_len)
        model = load_model(path, dtype, config.device, self.draft_max_positions + 1, draft_config,
                           False if config.prepack_weights is False else None)  # its dtype may not support it
        self.block_manager = BlockManager(config.num_kv_blocks, config.block_size)
        pool = KVPool(draft_config, config.num_kv_blocks, config.block_size, dtype, config.device)
        return DraftModelDrafter(model, draft_config, self.block_manager, pool, config.device,
                                 config.model_config.vocab_size)

    def lookahead(self, seq: Sequence) -> int:
        """Slots to reserve beyond the last token: k_eff = min(k, max_model_len - kv_len - 1, max_tokens_left - 1,
        draft positions - kv_len - 1), further lowered by adaptive k; with a tree, the tree's nodes at depth
        k_eff (while the batch is small enough for trees)."""
        k_cap = self._k_cap(seq)
        if k_cap <= 0:
            return 0
        if self.adaptive is not None:
            return self.adaptive.choose(seq.seq_id, self.batch_size, k_cap)
        if self.spec.uses_tree and self.batch_size <= self.spec.tree_max_batch_size:
            return self.spec.tree_nodes(k_cap)
        return k_cap

    def _k_cap(self, seq: Sequence) -> int:
        kv_len = seq.num_tokens - 1  # the last token's K/V is written by this step's forward
        left = seq.params.max_tokens - len(seq.output_token_ids)
        return min(self.k, self.config.max_model_len - kv_len - 1, left - 1, self.draft_max_positions - kv_len - 1)

    def free(self, seq: Sequence) -> None:
        self.drafter.free(seq)
        if self.adaptive is not None and seq.is_finished:
            self.adaptive.free(seq.seq_id)

    # --- one round, computed without touching any request (engine/step.py) ------------------------------
    def draft(self, batch: ScheduledBatch) -> Drafts:
        """Drafts for the decoding requests of ``batch`` that were granted a lookahead (k_eff > 0)."""
        speculating, ks, k_granted = [], [], {}
        for seq, n in zip(batch.seqs, batch.num_new_tokens):
            if n == 1 and seq.num_computed + 1 == seq.num_tokens:  # a decode step (not a prefill chunk)
                k_granted[seq.seq_id] = seq.lookahead
                if seq.lookahead > 0:
                    speculating.append(seq)
                    ks.append(seq.lookahead)
        if not speculating:
            return Drafts([], {}, None, k_granted, {})
        if self.spec.uses_tree and len(batch.seqs) <= self.spec.tree_max_batch_size:
            # the granted slots are the node budget; the depth stays within k_eff
            depths = [min(self._k_cap(s), k) for s, k in zip(speculating, ks)]
            proposal = self.drafter.propose_tree(speculating, depths, ks)
        else:
            proposal = self.drafter.propose(speculating, ks)
        # requests the drafter had nothing for take a plain step
        counts = proposal.counts()
        keep = [i for i, n in enumerate(counts) if n]
        seqs = [speculating[i] for i in keep]
        forwards = proposal.draft_forwards or [0] * len(speculating)
        host = proposal.token_ids
        return Drafts(
            seqs, {speculating[i].seq_id: counts[i] for i in keep}, _select(proposal, keep), k_granted,
            {s.seq_id: f for s, f in zip(speculating, forwards)},
            {speculating[i].seq_id: proposal.trees[i] for i in keep} if proposal.trees is not None else None,
            {speculating[i].seq_id: host[i] for i in keep} if host is not None else {},
        )

    def start_target_timer(self, device) -> object | None:
        """A start mark for timing the target forward, or None when adaptive k is off (nothing is timed)."""
        return self.timer.start(device) if self.timer is not None else None

    def observe_target(self, start: object, batch_size: int, num_tokens: int) -> None:
        """The target forward begun at ``start`` feeds the cost model (recorded by ``flush_timings``, no sync)."""
        self.timer.stop(start, lambda seconds: self.cost_model.observe_target(batch_size, num_tokens, seconds))

    def flush_timings(self) -> None:
        """Hand the cost model the forward timings that have completed (after the step's host read)."""
        if self.timer is not None:
            self.timer.flush()

    def verify(self, logits: torch.Tensor, drafts: Drafts) -> dict[int, tuple[list[int], int, list[int] | None]]:
        """seq id -> (emitted tokens, accepted drafts, accepted tree nodes or None for a chain) for every request
        in ``drafts.seqs``, in one host read that also brings back ``drafts.read_with`` (to ``drafts.read_back``).

        Args:
            logits: fp32 ``[sum(k_b + 1), V]``, the target rows of the verification windows in ``drafts.seqs``
                order (a tree's window: ``n_b + 1`` rows, its nodes in DFS order).
        """
        with_plain = {"read_with": drafts.read_with} if drafts.read_with is not None else {}  # a mixed step
        if drafts.trees is not None:
            result = verify_trees(logits, drafts.seqs, drafts.proposal, **with_plain)
            drafts.read_back = result.read_with
            return {s.seq_id: (e, a, nodes) for s, e, a, nodes in
                    zip(drafts.seqs, result.emitted, result.num_accepted, result.accepted_nodes)}
        result = verify(logits, drafts.seqs, drafts.proposal, method=self.spec.verify, **with_plain)
        drafts.read_back = result.read_with
        drafts.token_ids.update((s.seq_id, d) for s, d in zip(drafts.seqs, result.drafts))  # now on the host
        return {s.seq_id: (e, a, None) for s, e, a in zip(drafts.seqs, result.emitted, result.num_accepted)}

    def compact_trees(self, drafts: Drafts, verified: dict[int, tuple[list[int], int, list[int] | None]],
                      target_block_manager: BlockManager) -> None:
        """Move every tree's accepted path to contiguous positions after its root - in the target pool (node i was
        written at ``ctx + i``) and in the draft pool (the fed nodes sit level by level after the root) - with
        one ``ops.kv_compact`` per pool for the whole batch, and let the draft's valid length cover the moved
        prefix. Only positions beyond each request's committed KV are written (garbage until the commit), so a
        step that fails after this is still undone by ``undo_step``."""
        if drafts.trees is None:
            return
        target_src, target_dst, draft_src, draft_dst = [], [], [], []
        model = self._model_drafter
        for seq in drafts.seqs:
            _, _, nodes = verified[seq.seq_id]
            ctx = seq.num_computed  # the root's position
            src, dst = compaction_slots(target_block_manager, seq.seq_id, ctx, nodes)
            target_src += src
            target_dst += dst
            fed = model.tree_positions.pop(seq.seq_id, None) if model is not None else None
            if not fed:
                continue
            kept = 0
            for depth, node in enumerate(nodes, start=1):
                if node not in fed:
                    break  # a fed node's ancestors are fed: the path's fed nodes are a prefix of it
                if fed[node] != ctx + depth:
                    draft_src.append(self.block_manager.slot(seq.seq_id, fed[node]))
                    draft_dst.append(self.block_manager.slot(seq.seq_id, ctx + depth))
                kept = depth
            model.kv_len[seq.seq_id] = ctx + 1 + kept
        _compact(self.target_pool, target_src, target_dst)
        if model is not None:
            _compact(model.runner.pool, draft_src, draft_dst)

    def commit_round(self, seq: Sequence, drafted: int, accepted: int, target_block_manager: BlockManager) -> None:
        """Apply a verified round to the state outside the request: metrics, adaptive k, and the rollback -
        keep K/V of the last token and the accepted drafts (``seq.num_computed``, already committed), free
        whole blocks beyond it in both pools, and drop draft state beyond it. (A tree round's accepted path was
        already made contiguous by ``compact_trees``.)"""
        self._record(seq, drafted, accepted)
        if self.adaptive is not None:
            self.adaptive.observe(seq.seq_id, drafted, accepted)
        self.stats["rollback_freed_blocks"] += target_block_manager.truncate_to(seq.seq_id, seq.num_computed)
        if self.block_manager is not None:
            self.block_manager.truncate_to(seq.seq_id, seq.num_computed)
        self.drafter.rollback(seq, seq.num_computed)

    @staticmethod
    def _record(seq: Sequence, drafted: int, accepted: int) -> None:
        m = seq.metrics
        m.num_rounds += 1
        m.num_drafted += drafted
        m.num_accepted += accepted
        m.num_rejected_rounds += accepted < drafted
        grow = drafted - len(m.drafted_per_position)
        if grow > 0:
            m.drafted_per_position += [0] * grow
            m.accepted_per_position += [0] * grow
        for i in range(drafted):
            m.drafted_per_position[i] += 1
            m.accepted_per_position[i] += i < accepted


def _compact(pool: KVPool, src: list[int], dst: list[int]) -> None:
    if src:
        device = pool.tensors[0].device
        ops.kv_compact(pool.tensors, to_device(src, torch.int64, device), to_device(dst, torch.int64, device))


def target_input_ids(items: list[ForwardItem], drafts: Drafts | None, device: torch.device) -> torch.Tensor | None:
    """int64 ``[sum(len(item.token_ids))]`` on ``device``: the target forward's input ids when some verification
    window's drafts are only on the device - the items' host ids, with each such window's drafts scattered in
    (its ``token_ids`` hold placeholders there) - or None when every id is on the host. No host read.

    ``items`` are in batch order, and so are ``drafts.seqs`` and the proposal's device drafts."""
    if drafts is None or not drafts.seqs or drafts.trees is not None or drafts.proposal.token_ids is not None:
        return None
    windows = dict(zip((s.seq_id for s in drafts.seqs), drafts.proposal.counts()))
    slots, start = [], 0  # where each device draft goes in the flat ids, in drafts.seqs order
    for item in items:
        k = windows.get(item.seq_id)
        if k:
            slots += range(start + 1, start + 1 + k)  # after the window's last token
        start += len(item.token_ids)
    ids = to_device([t for item in items for t in item.token_ids], torch.int64, device)
    ids[to_device(slots, torch.int64, device)] = drafts.proposal.device_ids
    return ids


def _select(proposal: DraftProposal, keep: list[int]) -> DraftProposal:
    """The proposal restricted to requests ``keep`` (those that drafted at least one token; the q rows of the
    others are empty, so ``probs`` needs no slicing)."""
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
        probs = probs[to_device(rows, torch.int64, probs.device)]
    device_ids, bad_rows = proposal.device_ids, proposal.bad_rows
    if device_ids is not None:  # the drafts' flat rows of the kept requests
        starts = [0]
        for n in counts:
            starts.append(starts[-1] + n)
        index = to_device([r for i in keep for r in range(starts[i], starts[i + 1])], torch.int64,
                          device_ids.device)
        device_ids = device_ids[index]
        bad_rows = bad_rows[index] if bad_rows is not None else None
    host = [proposal.token_ids[i] for i in keep] if proposal.token_ids is not None else None
    return DraftProposal(host, probs, [proposal.is_onehot[i] for i in keep], None, trees, device_ids, bad_rows,
                         [counts[i] for i in keep])


@dataclass
class Drafts:
    """The drafting half of a round."""

    seqs: list[Sequence]  # requests that drafted at least one token, in batch order
    num_drafts: dict[int, int]  # seq id -> its number of drafts (k_b >= 1), for every request in ``seqs``
    proposal: DraftProposal | None  # restricted to ``seqs``
    k_granted: dict[int, int]  # seq id -> lookahead granted, for every decode step of the batch
    draft_forwards: dict[int, int]  # seq id -> draft-model forwards it took part in
    trees: dict[int, DraftTree] | None = None  # seq id -> its draft tree, when this round drafted trees
    # seq id -> its drafts on the host: from the drafter when it had them there (model-free drafters, trees,
    # penalties), else filled by verification's read
    token_ids: dict[int, list[int]] = field(default_factory=dict)
    # a mixed step's plain rows: int64 values on the device that verification's one host read brings back too,
    # and their host copy after it
    read_with: torch.Tensor | None = None
    read_back: list[int] = field(default_factory=list)
