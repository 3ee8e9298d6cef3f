"""The speculative half of a step: how far each request may speculate, drafting, verification, and what a verified
round leaves behind (compaction, rollback, metrics).

``engine/step.py`` runs the step: requests that do not speculate (prefill chunks, no lookahead granted, a
model-free proposer with no match) ride in the same target forward as plain rows. The round's data flow:

    draft(requests)                -> DraftRound (requests that drafted >= 1 token, their DraftProposal)
    metadata(round, layout)        -> SpecDecodeMetadata (built once; device offsets, drafts, tree structure)
    sampling_metadata(round)       -> SamplingMetadata of the window rows (settings, seeds, penalty contexts)
    verify_round(logits, ..., out) -> PendingVerification (queued; tokens after the step's one host read)
    compact(round, result)         -> a tree round's accepted paths contiguous in both caches
    observe_round / rollback       -> at commit: adaptive k's estimate; both caches truncated to the kept KV

This module never sees the engine's ``Sequence``: requests are :class:`~specdec.spec_decode.request.RequestView`s.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from specdec.cache.block_manager import BlockManager
from specdec.cache.kv_pool import KVPool
from specdec.config import EngineConfig, SpeculativeConfig
from specdec.device import to_device
from specdec.model.llama import LlamaForCausalLM
from specdec.runner.forward_timer import ForwardTimer
from specdec.runner.step_output import StepOutput
from specdec.sampling.metadata import SamplingMetadata
from specdec.spec_decode.adaptive import PLAIN, AdaptiveK, Arm
from specdec.spec_decode.calibration import calibrate
from specdec.spec_decode.compaction import compact_target
from specdec.spec_decode.cost_model import MeasuredCostModel
from specdec.spec_decode.metadata import SpecDecodeMetadata
from specdec.spec_decode.proposers.base import DraftProposal, Proposer
from specdec.spec_decode.proposers.draft_model import DraftModelProposer
from specdec.spec_decode.proposers.factory import build_proposer
from specdec.spec_decode.request import RequestView
from specdec.spec_decode.verify import PendingVerification, VerifyResult, verify_round
from specdec.tokenizer.tokenizer import Tokenizer


@dataclass
class DraftRound:
    """The drafting half of a round."""

    requests: list[RequestView]  # requests that drafted at least one token, in batch order
    proposal: DraftProposal | None  # restricted to ``requests``
    lookahead_granted: dict[int, int]  # seq id -> lookahead granted, for every decode step of the batch
    draft_forwards: dict[int, int]  # seq id -> draft-model forwards it took part in


class SpeculativeDecoder:
    def __init__(self, config: EngineConfig, spec_config: SpeculativeConfig, tokenizer: Tokenizer | None,
                 target: LlamaForCausalLM | None = None, draft_shard: tuple | None = None):
        self.spec_config = spec_config
        self.max_model_len = config.max_model_len
        self.vocab_size = config.model_config.vocab_size
        self.k_max = spec_config.num_speculative_tokens  # the longest chain (a tree's deepest path)
        self.device = config.device
        self.cost_model = spec_config.cost_model or MeasuredCostModel(is_model_free=not spec_config.drafts_with_a_model)
        # adaptive choices: the chain length (adaptive=True) and/or tree or chain per round (tree_policy "measured")
        self.adaptive = self._new_adaptive() if spec_config.adaptive or spec_config.measures_trees else None
        self.timer = ForwardTimer() if self.adaptive is not None else None  # forwards are timed for those only
        self._arms: dict[int, Arm] = {}  # seq id -> the arm chosen at its last lookahead (adaptive choices only)
        self.proposer: Proposer = build_proposer(config, spec_config, tokenizer, self.timer,
                                                 self.cost_model.observe_draft if self.timer is not None else None,
                                                 target=target, draft_shard=draft_shard)
        self.max_positions = self.proposer.max_positions or config.max_model_len
        self.stats = {"rollback_freed_blocks": 0}  # engine-wide counters (tests assert page-boundary rollbacks)
        self.batch_size = 1  # running requests, refreshed every step (adaptive k is chosen per batch size)
        self._target_runner = None  # set by calibrate (the engine's runner), for reset_adaptive's calibration

    def reset_adaptive(self) -> None:
        """Forget what adaptive k measured and estimated (a fresh cost model and acceptance): a cold start, as a new
        engine has, for an engine that was warmed up (benchmarks); calibrated again if it was. No-op without
        adaptive k or with injected costs."""
        if self.adaptive is None or self.spec_config.cost_model is not None:
            return
        self.cost_model = MeasuredCostModel(is_model_free=not self.spec_config.drafts_with_a_model)
        self.adaptive = self._new_adaptive()
        drafter = self.draft_model if self.draft_model is not None else self.proposer  # a draft model or EAGLE-3 head
        if getattr(drafter, "on_forward", None) is not None:  # model-free proposers time no draft forward
            drafter.on_forward = self.cost_model.observe_draft
        if self._target_runner is not None:
            self.calibrate(self._target_runner)

    def calibrate(self, target_runner) -> None:
        """Time the target's 1..k_max+1-token forwards and the draft model's step at batch 1 before the first
        request (specdec/spec_decode/calibration.py), so adaptive choices start from measured costs. The engine
        calls it once its runners are ready and idle. No-op without adaptive choices or with injected costs."""
        self._target_runner = target_runner
        if self.adaptive is None or self.spec_config.cost_model is not None:
            return
        draft = self.draft_model.runner if self.draft_model is not None else None
        calibrate(self.cost_model, target_runner, draft, self.k_max, min(self.max_positions, self.max_model_len))

    def _new_adaptive(self) -> AdaptiveK:
        spec = self.spec_config
        return AdaptiveK(self.k_max, self.cost_model, tree_nodes=spec.tree_nodes if spec.measures_trees else None,
                         adapt_depth=spec.adaptive)

    @property
    def block_managers(self) -> list[BlockManager]:
        """The proposer's KV pools (the scheduler allocates them in lockstep with the target's)."""
        return self.proposer.block_managers

    @property
    def draft_model(self) -> DraftModelProposer | None:
        """The draft model proposer (alone or inside a combined one), or None for a model-free method."""
        proposer = self.proposer
        return proposer if isinstance(proposer, DraftModelProposer) else getattr(proposer, "draft_model", None)

    @property
    def max_tree_nodes(self) -> int:
        """The most drafted nodes a round reserves slots for (a chain: k_max)."""
        return self.spec_config.tree_nodes(self.k_max)

    # --- how far each request may speculate (the scheduler asks before every step) ---------------------------
    def lookahead(self, request: RequestView) -> int:
        """Slots to reserve beyond the last token: the chain length k_eff = min(k_max, max_model_len - kv_len - 1,
        max_tokens_left - 1, draft positions - kv_len - 1); with adaptive choices the arm's (a chain's length, a
        tree's drafted nodes, at the depth chosen); with ``tree_policy="always"`` (while the batch is small enough
        for trees) the tree's drafted nodes at depth k_eff."""
        k_cap = self._k_cap(request)
        if k_cap <= 0:
            return 0
        if self.adaptive is not None:
            trees = self._trees_now(self.batch_size)
            arm = self.adaptive.choose_arm(request.seq_id, self.batch_size, k_cap, trees=trees)
            self._arms[request.seq_id] = arm
            return self.spec_config.tree_nodes(arm.depth) if arm.tree else arm.depth
        if self._trees_now(self.batch_size):
            return self.spec_config.tree_nodes(k_cap)
        return k_cap

    def _k_cap(self, request: RequestView) -> int:
        kv_len = request.num_tokens - 1  # the last token's K/V is written by this step's forward
        left = request.params.max_tokens - len(request.output_token_ids)
        return min(self.k_max, self.max_model_len - kv_len - 1, left - 1, self.max_positions - kv_len - 1)

    def _trees_now(self, batch_size: int) -> bool:
        return self.spec_config.uses_tree and batch_size <= self.spec_config.tree_max_batch_size

    def free(self, seq_id: int, finished: bool) -> None:
        """The request left the running batch (``finished``: for good; else preempted)."""
        self.proposer.free(seq_id, finished)
        self._arms.pop(seq_id, None)
        if self.adaptive is not None and finished:
            self.adaptive.free(seq_id)

    # --- one round, computed without changing any request (engine/step.py) -----------------------------------
    def draft(self, requests: list[RequestView], lookaheads: list[int], batch_size: int) -> DraftRound:
        """Drafts for ``requests`` (decode steps of the batch, with the lookahead the scheduler granted each).
        ``batch_size``: the step's requests in all (trees are drafted only while it is small enough)."""
        speculating = [r for r, n in zip(requests, lookaheads) if n > 0]
        budgets = [n for n in lookaheads if n > 0]  # a chain's length, or a tree's node budget
        granted = {r.seq_id: n for r, n in zip(requests, lookaheads)}
        if not speculating:
            return DraftRound([], None, granted, {})
        if self._tree_round(speculating, batch_size):
            depths = [min(self._k_cap(r), self._depth(r, n)) for r, n in zip(speculating, budgets)]
            start = self.timer.start(self.device) if self.timer is not None else None
            proposal = self.proposer.propose_tree(speculating, depths, budgets)
            if start is not None:  # the whole drafting: a draft model reads the host at every depth anyway
                depth = max(depths)
                self.timer.stop(start, lambda seconds: self.cost_model.observe_tree_draft(batch_size, depth, seconds))
        else:  # a request that chose a tree drafts the chain of the tree's depth (its slots hold it)
            proposal = self.proposer.propose(speculating, [self._depth(r, n) for r, n in zip(speculating, budgets)])
        # requests the proposer had nothing for take a plain step
        counts = proposal.counts()
        keep = [i for i, n in enumerate(counts) if n]
        forwards = proposal.draft_forwards or [0] * len(speculating)
        return DraftRound([speculating[i] for i in keep], _select(proposal, keep) if keep else None, granted,
                          {r.seq_id: f for r, f in zip(speculating, forwards)})

    def _tree_round(self, speculating: list[RequestView], batch_size: int) -> bool:
        """Trees this round: the batch is small enough and (measured policy) every drafting request chose one."""
        if not self._trees_now(batch_size):
            return False
        if not self.spec_config.measures_trees:
            return True
        return all(self._arms.get(r.seq_id, PLAIN).tree for r in speculating)

    def _depth(self, request: RequestView, granted: int) -> int:
        """The depth a request drafts to: its arm's (within the slots granted), else the slots granted."""
        arm = self._arms.get(request.seq_id)
        return min(arm.depth, granted) if arm is not None and arm.depth else granted

    def metadata(self, draft_round: DraftRound, logits_starts: list[int], input_starts: list[int], num_logits: int,
                 device: torch.device) -> SpecDecodeMetadata:
        """The round's :class:`SpecDecodeMetadata` once the step has laid out its forward: request b's window
        starts at logits row ``logits_starts[b]`` and flat input position ``input_starts[b]``."""
        return SpecDecodeMetadata.build(draft_round.proposal, logits_starts, input_starts, num_logits, device)

    def sampling_metadata(self, draft_round: DraftRound, meta: SpecDecodeMetadata,
                          device: torch.device) -> SamplingMetadata:
        """One row per window row: request b's settings and seed; the position of the row's token (the first
        draft's position + its depth); and, for requests with penalties, the context of the row - output + the
        drafts before it (a tree: the path to the row's node)."""
        params, seeds, positions, contexts = [], [], [], []
        for b, request in enumerate(draft_round.requests):
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

    def verify_round(self, logits: torch.Tensor, draft_round: DraftRound, meta: SpecDecodeMetadata,
               out: StepOutput) -> PendingVerification:
        """Queue the round's verification (``SpeculativeConfig.verify`` picks token or block for chains)."""
        sampling = self.sampling_metadata(draft_round, meta, logits.device)
        return verify_round(logits, meta, sampling, out, method=self.spec_config.verify)

    def compact(self, draft_round: DraftRound, result: VerifyResult, target_pool: KVPool,
                target_block_manager: BlockManager) -> None:
        """A tree round: every accepted path made contiguous after its root, in the target's cache and in the
        proposer's (positions beyond each request's committed KV only: a step that fails after this is still
        undone by ``discard``)."""
        if result.accepted_nodes is None:
            return
        requests = draft_round.requests
        compact_target(target_pool, target_block_manager, [r.seq_id for r in requests],
                       [r.num_computed for r in requests], result.accepted_nodes)
        self.proposer.compact(draft_round.requests, result.accepted_nodes)

    def discard(self, requests: list[RequestView]) -> None:
        """A step failed: forget the proposer's state beyond each request's committed KV (target K/V written
        beyond ``num_computed`` is garbage by definition and is overwritten later)."""
        for request in requests:
            self.proposer.discard(request, request.num_computed)

    # --- adaptive k's timings (no host sync: read after the step's host read) --------------------------------
    def start_target_timer(self, device: torch.device) -> object | None:
        """A start mark for timing the target forward, or None when adaptive k is off (nothing is timed)."""
        return self.timer.start(device) if self.timer is not None else None

    def observe_target(self, start: object, batch_size: int, num_tokens: int, tree: bool = False) -> None:
        """The target forward begun at ``start`` (``tree``: of tree windows) feeds the cost model (recorded by
        ``flush_timings``, no sync)."""
        self.timer.stop(start, lambda seconds: self.cost_model.observe_target(batch_size, num_tokens, seconds, tree))

    def flush_timings(self) -> None:
        """Hand the cost model the forward timings that have completed (after the step's host read)."""
        if self.timer is not None:
            self.timer.flush()

    # --- the commit of a verified round (LLMEngine, request by request) --------------------------------------
    def observe_round(self, seq_id: int, drafted: int, accepted: int, tree: bool = False) -> None:
        """A verified round of ``drafted`` drafts (a tree: its depth), ``accepted`` of them accepted: the adaptive
        choices' estimates."""
        if self.adaptive is not None:
            self.adaptive.observe(seq_id, drafted, accepted, tree)

    def rollback(self, request: RequestView, target_block_manager: BlockManager) -> None:
        """Keep the K/V of the last token and the accepted drafts (``request.num_computed``, already committed):
        free whole blocks beyond it in the target's pool, and the proposer's state and blocks beyond it. (A tree
        round's accepted path was already made contiguous by ``compact``.)"""
        kept = request.num_computed
        self.stats["rollback_freed_blocks"] += target_block_manager.truncate_to(request.seq_id, kept)
        self.proposer.rollback(request, kept)

    # --- the target's hidden states (an EAGLE-3 proposer; engine/step.py) ------------------------------------
    @property
    def aux_hidden_layers(self) -> tuple[int, ...] | None:
        """The target layers whose hidden states the proposer is fed (the target forward then captures them), or
        None: it reads none, and the forward captures nothing."""
        return getattr(self.proposer, "aux_hidden_layers", None)

    def keep_hidden_states(self, seq_ids: list[int], starts: list[int], counts: list[int],
                           hidden: torch.Tensor) -> None:
        """Hand the proposer the target's hidden states ``[sum(counts), len(aux_hidden_layers) * H]`` of the
        tokens each request keeps after this step: ``counts[i]`` of request ``seq_ids[i]`` from position
        ``starts[i]`` on, request-major (beyond the committed KV until the commit: ``discard`` drops them)."""
        self.proposer.take_hidden_states(seq_ids, starts, counts, hidden)


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
