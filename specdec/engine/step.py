"""One engine step, computed without changing any request: (draft) -> one ragged target forward -> sample / verify.

This is the one code path of a step, plain or speculative: a plain engine is a speculative one whose requests
never draft. ``compute_step`` returns a :class:`RequestUpdate` per request and mutates no ``Sequence`` (the draft
model's cache is written, but the drafter's view of it is undone by ``undo_step``), so a step that raises can be
retried on a smaller batch or dropped: ``LLMEngine`` applies the updates in its commit phase, request by
request. That split is what failure isolation rests on (docs/architecture.md, "Failure isolation").
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

from specdec.engine.model_runner import ForwardItem, ModelRunner
from specdec.engine.plain_step import plain_item, plain_tokens_from_host, sample_plain, sample_plain_on_device
from specdec.engine.scheduler import ScheduledBatch
from specdec.engine.sequence import Sequence
from specdec.engine.speculative import target_input_ids
from specdec.sampling.logprobs import TokenLogprobs, attach_logprobs

DEVICE_DRAFT = 0  # a verification window's placeholder id for a draft that is only on the device (input_ids)


@dataclass
class RequestUpdate:
    """What one step computed for one request; applied by ``LLMEngine`` at commit, never before."""

    seq: Sequence
    num_computed: int  # target KV length the request keeps after the step (rollback included)
    new_tokens: list[int]  # a sampled token, or the accepted drafts + correction/bonus; [] for a mid-prompt chunk
    k_granted: int | None = None  # speculation length granted at a decode step (metrics.k_per_step), else None
    drafted: int = 0
    accepted: int = 0
    verified: bool = False  # the tokens came from a verification round
    draft_forwards: int = 0
    accepted_nodes: list[int] | None = None  # a tree round: the accepted path's nodes (depth 1..accepted)
    logprobs: list[TokenLogprobs] | None = None  # one per new token when params.logprobs is set (logprobs hook)


def compute_step(batch: ScheduledBatch, runner: ModelRunner, spec=None, observe_costs: bool = True
                 ) -> list[RequestUpdate]:
    """The updates of every request of ``batch``, in batch order.

    Args:
        spec: the ``SpeculativeDecoder``, or None for plain decoding.
        observe_costs: time the target forward for adaptive k (False for the retried halves of a failed step).
    """
    drafts = spec.draft(batch) if spec is not None else None
    items: list[ForwardItem] = []
    for seq, n in zip(batch.seqs, batch.num_new_tokens):
        k = drafts.num_drafts.get(seq.seq_id) if drafts else None
        tree = drafts.trees.get(seq.seq_id) if drafts and drafts.trees else None
        if k and tree is not None:  # a tree window: its nodes in DFS order, node i at RoPE ctx + depth(i)
            items.append(ForwardItem(seq.seq_id, list(tree.token_ids), seq.num_computed, len(tree.token_ids),
                                     positions=[seq.num_computed + depth for depth in tree.depths],
                                     mask=tree.mask()))
        elif k:  # a verification window: the last token, then the drafts (placeholders while on the device)
            d = drafts.token_ids.get(seq.seq_id, [DEVICE_DRAFT] * k)
            items.append(ForwardItem(seq.seq_id, [seq.last_token_id] + d, seq.num_computed, k + 1))
        else:
            items.append(plain_item(seq, n))
    input_ids = target_input_ids(items, drafts, runner.device)  # the device drafts, never read to the host
    start = spec.start_target_timer(runner.device) if spec is not None and observe_costs else None
    # (sum of num_logits, V) fp32; input_ids only when there are device drafts
    logits = runner.forward(items) if input_ids is None else runner.forward(items, input_ids=input_ids)
    if start is not None:
        spec.observe_target(start, len(items), sum(len(it.token_ids) for it in items))

    spec_rows: list[int] = []
    plain_rows: list[int] = []
    plain_seqs: list[Sequence] = []
    row = 0
    for item, seq in zip(items, batch.seqs):
        rows = range(row, row + item.num_logits)
        if drafts and seq.seq_id in drafts.num_drafts:
            spec_rows.extend(rows)
        elif item.num_logits:
            plain_rows.extend(rows)
            plain_seqs.append(seq)
        row += item.num_logits
    if drafts and drafts.seqs and plain_seqs:  # a mixed step: the plain tokens ride in verification's one read
        drafts.read_with = sample_plain_on_device(logits[plain_rows], plain_seqs)
        verified = spec.verify(logits[spec_rows], drafts)
        sampled = plain_tokens_from_host(drafts.read_back, plain_seqs)
    else:
        sampled = sample_plain(logits[plain_rows], plain_seqs)
        verified = spec.verify(logits[spec_rows], drafts) if drafts and drafts.seqs else {}
    if verified and drafts.trees is not None:
        spec.compact_trees(drafts, verified, runner.block_manager)  # accepted paths -> contiguous K/V

    updates = []
    for seq, n in zip(batch.seqs, batch.num_new_tokens):
        k_granted = drafts.k_granted.get(seq.seq_id) if drafts else None
        forwards = drafts.draft_forwards.get(seq.seq_id, 0) if drafts else 0
        if seq.seq_id in verified:
            emitted, accepted, nodes = verified[seq.seq_id]
            tree = drafts.trees.get(seq.seq_id) if drafts.trees else None
            # drafted positions: a chain's length, a tree's depth (its node count is in the proposal)
            drafted = tree.max_depth if tree is not None else drafts.num_drafts[seq.seq_id]
            updates.append(RequestUpdate(seq, seq.num_computed + 1 + accepted, emitted, k_granted, drafted,
                                         accepted, True, forwards, accepted_nodes=nodes))
        else:
            updates.append(RequestUpdate(seq, seq.num_computed + n, sampled.get(seq.seq_id, []), k_granted,
                                         draft_forwards=forwards))

    # --- logprobs hook (sampling/logprobs.py), only when a request asked: the logits row each emitted token was
    # drawn from - a plain token: its item's one row; a verified chain: token j from row j of its window.
    if any(seq.params.logprobs is not None for seq in batch.seqs):
        starts = itertools.accumulate((item.num_logits for item in items), initial=0)
        first_row = {seq.seq_id: start for seq, start in zip(batch.seqs, starts)}
        token_rows = {u.seq.seq_id: [first_row[u.seq.seq_id] + j for j in range(len(u.new_tokens))] for u in updates}
        for u in updates:  # a tree: token j comes from the row of the path's node at depth j (the root's for j = 0)
            if u.accepted_nodes is not None:
                token_rows[u.seq.seq_id] = [first_row[u.seq.seq_id] + node for node in [0, *u.accepted_nodes]]
        attach_logprobs(logits, updates, token_rows)
    if spec is not None:
        spec.flush_timings()  # after the step's host read: the timed forwards have completed
    return updates


def undo_step(seqs: list[Sequence], spec=None) -> None:
    """Forget what a failed ``compute_step`` left behind: the drafters' state beyond each request's committed
    KV. (Target K/V written beyond ``num_computed`` is garbage by definition and is overwritten later.)"""
    if spec is not None:
        for seq in seqs:
            spec.drafter.rollback(seq, seq.num_computed)
