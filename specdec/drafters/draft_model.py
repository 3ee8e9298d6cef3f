"""A smaller model drafts k tokens autoregressively, batched over every speculating request.

The draft has its own paged KV pool whose blocks are allocated and freed in lockstep with the target's (the
scheduler reserves both). Its cache is filled lazily and caught up in one ragged prefill fused into the first
draft step: whatever tokens it lacks (the prompt on first use; the last draft and the bonus token after an
all-accepted round; tokens from plain steps) are fed before it drafts. Invariant when drafting starts: the
draft's KV covers exactly the tokens the target's covers, plus the catch-up it is fed in that same forward.

A draft vocabulary smaller than the target's (Qwen2.5-7B+ targets have 152064 ids, their 0.5B-3B drafts 151936):
the draft never sees an id it does not have. Such ids in the context are fed to it as ``UNKNOWN_ID_STANDIN``
and left out of its penalty context; its q is zero on them, so it never proposes them, and verification (which
uses exactly that q) stays lossless - the target still emits them through the residual or bonus token.
"""

from __future__ import annotations

import functools

import torch

from specdec.cache.block_manager import BlockManager
from specdec.cache.kv_pool import KVPool
from specdec.device import to_device
from specdec.drafters.base import DraftProposal
from specdec.drafters.draft_tree import TreeShape, propose_tree
from specdec.engine.adaptive import ForwardTimer
from specdec.engine.model_runner import ForwardItem, ModelRunner
from specdec.engine.sequence import Sequence
from specdec.kernels.philox import STREAM_DRAFT, round_stream
from specdec.model.config import ModelConfig
from specdec.model.llama import LlamaForCausalLM
from specdec.sampling.sampler import sample_rows

UNKNOWN_ID_STANDIN = 0  # what the draft is fed in place of a target id beyond its vocabulary


class DraftModelDrafter:
    def __init__(self, model: LlamaForCausalLM, config: ModelConfig, block_manager: BlockManager, pool: KVPool,
                 device: torch.device, target_vocab_size: int):
        self.config = config
        self.block_manager = block_manager
        self.runner = ModelRunner(model, pool, block_manager, device)
        self.target_vocab_size = target_vocab_size
        self.vocab_size = config.vocab_size  # <= target_vocab_size (drafters/compat.py)
        self.kv_len: dict[int, int] = {}  # seq id -> tokens whose K/V are valid in the draft cache
        # adaptive k's draft timings: the timer (engine/adaptive.py) and its callback (batch_size, seconds) per
        # draft step; both None when adaptive k is off (nothing is timed)
        self.timer: ForwardTimer | None = None
        self.on_forward = None
        self.tree_shape: TreeShape | None = None  # how propose_tree grows trees (set by the SpeculativeDecoder)
        # seq id -> {tree node (DFS index) -> its position in the draft cache}, for the nodes fed this round
        self.tree_positions: dict[int, dict[int, int]] = {}
        # Key draft j's noise by (round start, j) instead of its position: block verification looks at drafts
        # beyond those it emits, so the next round must not redraw them with the same noise (kernels/block_verify.py)
        self.noise_per_round = False

    def propose_tree(self, seqs: list[Sequence], max_depths: list[int], max_nodes: list[int]) -> DraftProposal:
        """A draft tree per request (depth <= ``max_depths[i]``, at most ``max_nodes[i]`` drafted nodes), grown by
        ``tree_shape``; see specdec/drafters/draft_tree.py."""
        shape = self.tree_shape or TreeShape([1] * max(max_depths, default=0), 1)  # no shape: chains as trees
        return propose_tree(self, seqs, max_depths, max_nodes, shape)

    def propose(self, seqs: list[Sequence], num_tokens: list[int]) -> DraftProposal:
        """Draft ``num_tokens[i]`` tokens for ``seqs[i]``, batched: k steps, each one forward over the requests
        still drafting. No host read: the drafted ids stay on the device (``DraftProposal.device_ids``, with the
        NaN/inf flags of every step in ``bad_rows``) through the target forward, and come to the host with the
        verification result - unless a request uses penalties: their context needs the drafts so far on the
        host, so then each step reads its tokens (``token_ids`` is then filled too)."""
        q_rows: list[list[torch.Tensor | None]] = [[] for _ in seqs]
        step_tokens: list[torch.Tensor] = []  # per step: int64 [len(active)] drafted ids, on the device
        owners: list[int] = []  # request of each row of torch.cat(step_tokens)
        bad_rows: list[torch.Tensor] = []  # per step: bool [len(active)] rows with NaN/inf draft logits
        host_drafts: list[list[int]] | None = [[] for _ in seqs] if any(s.params.has_penalties for s in seqs) else None
        active = [i for i, k in enumerate(num_tokens) if k > 0]
        # Step 0 feeds everything the draft cache lacks (lazy prefill / catch-up) and drafts the first token.
        items = []
        for i in active:
            seq = seqs[i]
            have = self.kv_len.get(seq.seq_id, 0)
            items.append(ForwardItem(seq.seq_id, self._in_vocab(seq.all_token_ids[have:]), have, 1))
        input_ids = None  # after step 0: the previous step's drafts, still on the device
        step = 0
        while items:
            # step 0 includes catch-up: only pure draft steps are timed (for adaptive k; no host sync)
            timed = self.timer is not None and step > 0
            start = self.timer.start(self.runner.device) if timed else None
            logits = self.runner.forward(items, input_ids=input_ids)  # (len(items), V_draft)
            if timed:
                self.timer.stop(start, functools.partial(self.on_forward, len(items)))
            for i in active:
                self.kv_len[seqs[i].seq_id] = seqs[i].num_tokens + step
            tokens, probs = self._sample(logits, [seqs[i] for i in active], step,
                                         [host_drafts[i] for i in active] if host_drafts else None, bad_rows)
            step_tokens.append(tokens)
            owners += active
            if host_drafts is not None:
                for i, t in zip(active, tokens.tolist()):  # penalties need the drafts on the host every step
                    host_drafts[i].append(t)
            for row, i in enumerate(active):
                q_rows[i].append(probs[row] if probs is not None else None)
            step += 1
            keep = [row for row, i in enumerate(active) if num_tokens[i] > step]
            active = [active[row] for row in keep]
            input_ids = tokens if len(keep) == len(tokens) else tokens[to_device(keep, torch.int64, tokens.device)]
            items = [ForwardItem(seqs[i].seq_id, [UNKNOWN_ID_STANDIN], seqs[i].num_tokens + step - 1, 1)
                     for i in active]  # the ids themselves come from input_ids
        counts = [len(rows) for rows in q_rows]
        device_ids, bad = _request_major(step_tokens, bad_rows, owners, self.runner.device)
        is_onehot = [seq.params.is_greedy for seq in seqs]  # greedy drafts are deterministic: q is one-hot
        flat_q = [q for i, rows in enumerate(q_rows) if not is_onehot[i] for q in rows]
        probs = None
        if flat_q:
            vocab = self.target_vocab_size
            probs = torch.zeros(sum(counts), vocab, dtype=torch.float32, device=flat_q[0].device)
            r = 0
            for i, rows in enumerate(q_rows):
                for q in rows:
                    if q is not None and not is_onehot[i]:
                        probs[r, : q.shape[0]] = q  # a smaller draft vocab is zero-padded
                    r += 1
        # request i took part in one draft forward per draft token (the first includes its catch-up)
        return DraftProposal(host_drafts, probs, is_onehot, counts, device_ids=device_ids, bad_rows=bad,
                             num_drafts=counts)

    def _in_vocab(self, ids: list[int]) -> list[int]:
        """``ids`` as the draft may see them: ids beyond its vocabulary replaced by ``UNKNOWN_ID_STANDIN``."""
        if self.vocab_size >= self.target_vocab_size:
            return ids
        return [t if t < self.vocab_size else UNKNOWN_ID_STANDIN for t in ids]

    def _sample(self, logits: torch.Tensor, seqs: list[Sequence], step: int, drafts: list[list[int]] | None,
                bad_rows: list[torch.Tensor]):
        """Draw the next draft token of each row from q, the standardized draft distribution (same transform and
        the same penalty context - prompt + output + earlier drafts - as the target's p). ``drafts``: the drafts
        so far on the host, needed only for penalties (None otherwise). NaN/inf rows are reported into
        ``bad_rows``, not raised, so that the check costs no host read here."""
        per_round = self.noise_per_round
        return sample_rows(
            logits,
            [s.params for s in seqs],
            [s.seed for s in seqs],
            [s.num_tokens + (0 if per_round else step) for s in seqs],
            [self._known(s.prompt_token_ids) for s in seqs] if drafts is not None else [[] for _ in seqs],
            [self._known(s.output_token_ids) + d for s, d in zip(seqs, drafts)] if drafts is not None
            else [[] for _ in seqs],
            round_stream(STREAM_DRAFT, step) if per_round else STREAM_DRAFT,
            bad_rows=bad_rows,
        )

    def _known(self, ids: list[int]) -> list[int]:
        """``ids`` without those beyond the draft's vocabulary (they have no logit to penalise)."""
        if self.vocab_size >= self.target_vocab_size:
            return ids
        return [t for t in ids if t < self.vocab_size]

    def rollback(self, seq: Sequence, kv_len: int) -> None:
        if seq.seq_id in self.kv_len:
            self.kv_len[seq.seq_id] = min(self.kv_len[seq.seq_id], kv_len)
        # a tree's node positions are valid only within the step that drafted it (a retried or failed step
        # must never compact stale ones into the cache)
        self.tree_positions.pop(seq.seq_id, None)

    def free(self, seq: Sequence) -> None:
        self.kv_len.pop(seq.seq_id, None)
        self.tree_positions.pop(seq.seq_id, None)


def _request_major(step_tokens: list[torch.Tensor], bad_rows: list[torch.Tensor], owners: list[int],
                   device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """The drafts and their NaN/inf flags in request order: ``(int64 [N], bool [N])`` from the step-major rows
    (``owners[r]``: the request of row r of the concatenated steps); no host read."""
    if not step_tokens:
        return (torch.zeros(0, dtype=torch.int64, device=device), torch.zeros(0, dtype=torch.bool, device=device))
    order = sorted(range(len(owners)), key=owners.__getitem__)  # stable: a request's rows stay in step order
    index = to_device(order, torch.int64, device)
    return torch.cat(step_tokens)[index], torch.cat(bad_rows)[index]
