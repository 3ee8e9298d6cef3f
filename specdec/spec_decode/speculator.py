"""Speculator: the engine's speculative side - one proposer, one policy - and the two things that take both.

    draft(requests, lookaheads)  -> SpeculativeRound   the policy plans the round, the proposer drafts it
    finish_round(request, ...)                          at the commit of a verified round, in one place: what the
                                                        policy learns, the accepted path moved, both caches cut
    discard / free                                      a failed step undone; a request gone

Everything else is asked of the parts directly: ``speculator.policy`` (lookahead, adaptive k, calibration, timing)
and ``speculator.proposer`` (its pools, its draft model, the hidden states it reads).
"""

from __future__ import annotations

import contextlib

from specdec.cache.block_manager import BlockManager
from specdec.cache.kv_pool import KVPool
from specdec.config import EngineConfig, SpeculativeConfig
from specdec.model.llama import LlamaForCausalLM
from specdec.spec_decode.accepted_path import move_accepted_path
from specdec.spec_decode.forced_drafts import fit_to_grammar
from specdec.spec_decode.policy import SpeculationPolicy, StepTiming
from specdec.spec_decode.proposers.base import Proposer
from specdec.spec_decode.proposers.factory import build_proposer
from specdec.spec_decode.request import RequestView
from specdec.spec_decode.round import SpeculativeRound
from specdec.tokenizer.tokenizer import Tokenizer


class Speculator:
    """Built once per engine from its config and ``SpeculativeConfig`` (``target``, ``draft_shard``: see
    ``proposers/factory.build_proposer``)."""

    def __init__(self, config: EngineConfig, spec_config: SpeculativeConfig, tokenizer: Tokenizer | None,
                 target: LlamaForCausalLM | None = None, draft_shard: tuple | None = None):
        self.spec_config = spec_config
        self.vocab_size = config.model_config.vocab_size
        self.policy = SpeculationPolicy(config, spec_config)
        timed = self.policy.timer is not None
        self.proposer: Proposer = build_proposer(config, spec_config, tokenizer, self.policy.timer,
                                                 self.policy.observe_draft if timed else None,
                                                 target=target, draft_shard=draft_shard)
        self.policy.max_positions = self.proposer.max_positions or config.max_model_len
        self.stats = {"rollback_freed_blocks": 0}  # engine-wide counters (tests assert page-boundary rollbacks)

    def draft(self, requests: list[RequestView], lookaheads: list[int], batch_size: int,
              timing: StepTiming | None = None) -> SpeculativeRound:
        """The round of ``requests`` (the batch's decode steps, with the lookahead the scheduler granted each);
        ``batch_size``: the step's requests in all; ``timing``: the step's (a tree round's drafting is timed)."""
        plan = self.policy.plan(requests, lookaheads, batch_size)
        granted = {r.seq_id: n for r, n in zip(requests, lookaheads)}
        proposal = None
        if plan.trees:
            timed = timing.tree_draft(batch_size, max(plan.depths)) if timing else contextlib.nullcontext()
            with timed:
                proposal = self.proposer.propose_tree(plan.requests, plan.depths, plan.budgets)
        elif plan.requests:
            proposal = self.proposer.propose(plan.requests, plan.depths)
            model_free = self.proposer.draft_model is None and self.proposer.aux_hidden_layers is None
            if model_free and any(r.grammar is not None for r in plan.requests):
                proposal = fit_to_grammar(proposal, plan.requests, plan.depths)  # cut to the grammar, forced text
        return SpeculativeRound(plan.requests, proposal, granted, self.spec_config.verify, self.vocab_size)

    def finish_round(self, request: RequestView, kept: int, drafted: int, accepted: int,
                     accepted_nodes: list[int] | None, target_pool: KVPool, target_block_manager: BlockManager) -> None:
        """A verified round of ``request`` is committed; called before ``request.num_computed`` advances to
        ``kept`` (the last token's K/V and the accepted drafts'). The policy observes ``drafted`` / ``accepted``; a
        tree round's accepted path (``accepted_nodes``) moves right after its root in the target's cache and the
        proposer's; then both caches are cut to ``kept`` - whole blocks beyond it go back to their pools."""
        self.policy.observe_round(request.seq_id, drafted, accepted, tree=accepted_nodes is not None)
        if accepted_nodes is not None:
            move_accepted_path(target_pool, target_block_manager, request.seq_id, request.num_computed,
                               accepted_nodes)
            self.proposer.move_accepted_path(request, accepted_nodes)
        self.stats["rollback_freed_blocks"] += target_block_manager.truncate_to(request.seq_id, kept)
        self.proposer.rollback(request, kept)

    def discard(self, requests: list[RequestView]) -> None:
        """A step failed: forget the proposer's state beyond each request's committed KV (target K/V written
        beyond ``num_computed`` is garbage by definition and is overwritten later)."""
        for request in requests:
            self.proposer.discard(request, request.num_computed)

    def free(self, seq_id: int, finished: bool) -> None:
        """The request left the running batch (``finished``: for good; else preempted)."""
        self.proposer.free(seq_id, finished)
        self.policy.free(seq_id, finished)
