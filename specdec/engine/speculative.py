"""The speculative step: draft -> one ragged target forward -> verify -> rollback, for every running request.

Requests that do not speculate this step (prefill chunks, ``k_eff <= 0``, a model-free drafter with no match)
ride in the same target forward as plain rows, with no verification overhead. Stop conditions are checked
afterwards, on accepted tokens only (engine._process).
"""

from __future__ import annotations

import time

import torch

from specdec.cache.block_manager import BlockManager
from specdec.cache.kv_pool import KVPool
from specdec.config import EngineConfig, SpeculativeConfig, eos_ids
from specdec.drafters.combined import CombinedDrafter
from specdec.drafters.compat import check_draft_compatible
from specdec.drafters.draft_model import DraftModelDrafter
from specdec.drafters.ngram import NgramDrafter
from specdec.drafters.prompt_lookup import PromptLookupDrafter
from specdec.engine.adaptive import AdaptiveK, MeasuredCostModel
from specdec.engine.model_runner import ForwardItem, ModelRunner
from specdec.engine.plain_step import plain_item, sample_plain
from specdec.engine.scheduler import ScheduledBatch
from specdec.engine.sequence import Sequence
from specdec.model.config import ModelConfig, resolve_dtype
from specdec.model.loader import load_model, resolve_model_path
from specdec.model.tokenizer import Tokenizer
from specdec.sampling.verify import verify


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
        if spec.method == "draft_model":
            self.drafter = model_drafter
        elif spec.method == "combined":
            self.drafter = CombinedDrafter(lookup, model_drafter)
        else:
            self.drafter = lookup
        self.cost_model = spec.cost_model or MeasuredCostModel(is_model_free=not spec.uses_draft_model)
        self.adaptive = AdaptiveK(self.k, self.cost_model) if spec.adaptive else None
        if model_drafter is not None:
            model_drafter.on_forward = self.cost_model.observe_draft
        self.last_verified: set[int] = set()
        self.batch_size = 1  # running requests, refreshed every step (adaptive k is chosen per batch size)

    def _load_draft_model(self, tokenizer: Tokenizer | None) -> DraftModelDrafter:
        config, spec = self.config, self.spec
        path = resolve_model_path(spec.draft_model)
        draft_config = ModelConfig.from_json(path)
        check_draft_compatible(config.model_config, draft_config, tokenizer, Tokenizer.from_dir(path),
                               config.eos_token_ids, eos_ids(path, draft_config))
        dtype = resolve_dtype(spec.draft_dtype, draft_config) if spec.draft_dtype else config.dtype
        # the draft writes positions up to max_model_len - 1 at most, like the target
        self.draft_max_positions = min(draft_config.max_position_embeddings, config.max_model_len)
        model = load_model(path, dtype, config.device, self.draft_max_positions + 1, draft_config,
                           False if config.prepack_weights is False else None)  # its dtype may not support it
        self.block_manager = BlockManager(config.num_kv_blocks, config.block_size)
        pool = KVPool(draft_config, config.num_kv_blocks, config.block_size, dtype, config.device)
        return DraftModelDrafter(model, draft_config, self.block_manager, pool, config.device,
                                 config.model_config.vocab_size)

    def lookahead(self, seq: Sequence) -> int:
        """k_eff = min(k, max_model_len - kv_len - 1, max_tokens_left - 1, draft positions - kv_len - 1),
        further lowered by adaptive k."""
        kv_len = seq.num_tokens - 1  # the last token's K/V is written by this step's forward
        left = seq.params.max_tokens - len(seq.output_token_ids)
        k_cap = min(self.k, self.config.max_model_len - kv_len - 1, left - 1, self.draft_max_positions - kv_len - 1)
        if k_cap <= 0:
            return 0
        if self.adaptive is not None:
            return self.adaptive.choose(seq.seq_id, self.batch_size, k_cap)
        return k_cap

    def free(self, seq: Sequence) -> None:
        self.drafter.free(seq)
        if self.adaptive is not None and seq.is_finished:
            self.adaptive.free(seq.seq_id)

    def step(self, batch: ScheduledBatch, runner: ModelRunner,
             target_block_manager: BlockManager) -> dict[int, list[int]]:
        """One round for ``batch``; returns the new tokens of each sequence that produced any."""
        self.batch_size = len(batch.seqs)
        self.last_verified: set[int] = set()  # sequences whose tokens this step came from a verification round
        speculating, ks = [], []
        for seq, n in zip(batch.seqs, batch.num_new_tokens):
            if n == 1 and seq.num_computed + 1 == seq.num_tokens:
                seq.metrics.k_per_step.append(seq.lookahead)
                if seq.lookahead > 0:
                    speculating.append(seq)
                    ks.append(seq.lookahead)
        proposal = self.drafter.propose(speculating, ks) if speculating else None
        # requests the drafter had nothing for take a plain step
        drafts = {seq.seq_id: d for seq, d in zip(speculating, proposal.token_ids) if d} if proposal else {}
        # One ragged target forward: [last, d1..dk] for speculating rows, chunks/decodes for the others.
        items, plain = [], []
        for seq, n in zip(batch.seqs, batch.num_new_tokens):
            if seq.seq_id in drafts:
                d = drafts[seq.seq_id]
                items.append(ForwardItem(seq.seq_id, [seq.all_token_ids[-1]] + d, seq.num_computed, len(d) + 1))
            else:
                items.append(plain_item(seq, n))
                if items[-1].num_logits:
                    plain.append(seq)
        start = time.perf_counter()
        logits = runner.forward(items)  # (sum of num_logits, V)
        if logits.is_cuda:
            torch.cuda.synchronize()
        self.cost_model.observe_target(len(items), sum(len(it.token_ids) for it in items),
                                       time.perf_counter() - start)
        new_tokens: dict[int, list[int]] = {}
        spec_rows, plain_rows, row = [], [], 0
        for item, seq in zip(items, batch.seqs):
            rows = list(range(row, row + item.num_logits))
            (spec_rows if seq.seq_id in drafts else plain_rows).extend(rows)
            row += item.num_logits
            seq.metrics.target_forwards += 1
        new_tokens.update(sample_plain(logits[plain_rows], plain))
        for seq, n in zip(batch.seqs, batch.num_new_tokens):
            if seq.seq_id not in drafts:
                seq.num_computed += n
        if drafts:
            spec_seqs = [s for s in speculating if s.seq_id in drafts]
            spec_drafts = [drafts[s.seq_id] for s in spec_seqs]
            result = verify(logits[spec_rows], spec_seqs, _select(proposal, speculating, drafts))
            for seq, d, emitted, accepted in zip(spec_seqs, spec_drafts, result.emitted, result.num_accepted):
                self._record(seq, len(d), accepted)
                if self.adaptive is not None:
                    self.adaptive.observe(seq.seq_id, len(d), accepted)
                # Rollback: keep K/V of the last token and the accepted drafts; free blocks beyond, in both pools.
                seq.num_computed += 1 + accepted
                self.stats["rollback_freed_blocks"] += target_block_manager.truncate_to(seq.seq_id, seq.num_computed)
                if self.block_manager is not None:
                    self.block_manager.truncate_to(seq.seq_id, seq.num_computed)
                self.drafter.rollback(seq, seq.num_computed)
                new_tokens[seq.seq_id] = emitted
                self.last_verified.add(seq.seq_id)
        return new_tokens

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


def _select(proposal, seqs: list[Sequence], drafts: dict[int, list[int]]):
    """The proposal restricted to the requests that drafted at least one token (q rows of the others are empty)."""
    from specdec.drafters.base import DraftProposal

    keep = [i for i, s in enumerate(seqs) if s.seq_id in drafts]
    if len(keep) == len(seqs):
        return proposal
    return DraftProposal([proposal.token_ids[i] for i in keep], proposal.probs, [proposal.is_onehot[i] for i in keep])
