"""The speculative step: draft -> one ragged target forward -> verify -> rollback, for every running request.

Requests that cannot speculate this step (prefill chunks, ``k_eff <= 0``) ride in the same target forward as
plain rows. Stop conditions are checked afterwards, on accepted tokens only (engine._process).
"""

from __future__ import annotations

import torch

from specdec.cache.block_manager import BlockManager
from specdec.cache.kv_pool import KVPool
from specdec.config import EngineConfig, SpeculativeConfig, eos_ids
from specdec.drafters.compat import check_draft_compatible
from specdec.drafters.draft_model import DraftModelDrafter
from specdec.engine.model_runner import ForwardItem, ModelRunner
from specdec.engine.scheduler import ScheduledBatch
from specdec.engine.sequence import Sequence
from specdec.model.config import ModelConfig, resolve_dtype
from specdec.model.loader import load_model, resolve_model_path
from specdec.model.tokenizer import Tokenizer
from specdec.sampling.sampler import sample_next_tokens
from specdec.sampling.verify import verify


class SpeculativeDecoder:
    def __init__(self, config: EngineConfig, spec: SpeculativeConfig, tokenizer: Tokenizer | None):
        self.config = config
        self.spec = spec
        self.k = spec.num_speculative_tokens
        path = resolve_model_path(spec.draft_model)
        draft_config = ModelConfig.from_json(path)
        check_draft_compatible(config.model_config, draft_config, tokenizer, Tokenizer.from_dir(path),
                               config.eos_token_ids, eos_ids(path, draft_config))
        dtype = resolve_dtype(spec.draft_dtype, draft_config) if spec.draft_dtype else config.dtype
        # the draft writes positions up to max_model_len - 1 at most, like the target
        self.draft_max_positions = min(draft_config.max_position_embeddings, config.max_model_len)
        model = load_model(path, dtype, config.device, self.draft_max_positions + 1, draft_config)
        self.block_manager = BlockManager(config.num_kv_blocks, config.block_size)
        pool = KVPool(draft_config, config.num_kv_blocks, config.block_size, dtype, config.device)
        self.stats = {"rollback_freed_blocks": 0}  # engine-wide counters (tests assert page-boundary rollbacks)
        self.drafter = DraftModelDrafter(model, draft_config, self.block_manager, pool, config.device,
                                         config.model_config.vocab_size)

    def lookahead(self, seq: Sequence) -> int:
        """k_eff = min(k, max_model_len - kv_len - 1, max_tokens_left - 1, draft positions - kv_len - 1)."""
        kv_len = seq.num_tokens - 1  # the last token's K/V is written by this step's forward
        left = seq.params.max_tokens - len(seq.output_token_ids)
        k_eff = min(self.k, self.config.max_model_len - kv_len - 1, left - 1, self.draft_max_positions - kv_len - 1)
        return max(k_eff, 0)

    def free(self, seq: Sequence) -> None:
        self.drafter.free(seq)

    def step(self, batch: ScheduledBatch, runner: ModelRunner,
             target_block_manager: BlockManager) -> dict[int, list[int]]:
        """One round for ``batch``; returns the new tokens of each sequence that produced any."""
        speculating, ks = [], []
        for seq, n in zip(batch.seqs, batch.num_new_tokens):
            if n == 1 and seq.num_computed + 1 == seq.num_tokens and seq.lookahead > 0:
                speculating.append(seq)
                ks.append(seq.lookahead)
        proposal = self.drafter.propose(speculating, ks) if speculating else None
        drafts = {seq.seq_id: d for seq, d in zip(speculating, proposal.token_ids)} if proposal else {}
        # One ragged target forward: [last, d1..dk] for speculating rows, chunks/decodes for the others.
        items, plain = [], []
        for seq, n in zip(batch.seqs, batch.num_new_tokens):
            tokens = seq.all_token_ids[seq.num_computed : seq.num_computed + n]
            if seq.seq_id in drafts:
                d = drafts[seq.seq_id]
                items.append(ForwardItem(seq.seq_id, tokens + d, seq.num_computed, len(d) + 1))
            else:
                completes = seq.num_computed + n == seq.num_tokens
                items.append(ForwardItem(seq.seq_id, tokens, seq.num_computed, 1 if completes else 0))
                if completes:
                    plain.append(seq)
        logits = runner.forward(items)  # (sum of num_logits, V)
        new_tokens: dict[int, list[int]] = {}
        spec_rows, plain_rows, row = [], [], 0
        for item, seq in zip(items, batch.seqs):
            rows = list(range(row, row + item.num_logits))
            (spec_rows if seq.seq_id in drafts else plain_rows).extend(rows)
            row += item.num_logits
            seq.metrics.target_forwards += 1
        if plain:
            tokens = sample_next_tokens(
                logits[plain_rows], [s.params for s in plain], [s.seed for s in plain], [s.num_tokens for s in plain],
                [s.prompt_token_ids for s in plain], [s.output_token_ids for s in plain],
            ).tolist()
            new_tokens.update({s.seq_id: [t] for s, t in zip(plain, tokens)})
        for seq, n in zip(batch.seqs, batch.num_new_tokens):
            if seq.seq_id not in drafts:
                seq.num_computed += n
        if speculating:
            result = verify(logits[spec_rows], speculating, proposal)
            for seq, d, emitted, accepted in zip(speculating, proposal.token_ids, result.emitted,
                                                 result.num_accepted):
                self._record(seq, len(d), accepted)
                # Rollback: keep K/V of the last token and the accepted drafts; free blocks beyond, in both pools.
                seq.num_computed += 1 + accepted
                freed = target_block_manager.truncate_to(seq.seq_id, seq.num_computed)
                self.block_manager.truncate_to(seq.seq_id, seq.num_computed)
                self.stats["rollback_freed_blocks"] += freed
                self.drafter.rollback(seq, seq.num_computed)
                new_tokens[seq.seq_id] = emitted
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
