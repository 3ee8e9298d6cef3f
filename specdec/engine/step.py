"""One engine step, computed without changing any request: (draft) -> one ragged target forward -> sample / verify.

This is the one code path of a step, plain or speculative: a plain engine is a speculative one whose requests
never draft. The round as data (docs/architecture.md, "One step"):

    SpeculativeDecoder.draft      -> DraftRound          which requests verify, their DraftProposal
    the forward's layout          -> ForwardItems        one per request: a plain chunk or a verification window
    SpeculativeDecoder.metadata   -> SpecDecodeMetadata  built once: offsets, drafts, trees - on the device
    ModelRunner.forward           -> logits [R, V]
    sample_plain / verify         -> queued on the device, registered in the step's StepOutput
    StepOutput.read               -> the step's one host read
    results -> compaction -> RequestUpdate per request

``compute_step`` returns a :class:`RequestUpdate` per request and mutates no ``Sequence`` (the draft model's cache
is written, but its view of it is undone by ``SpeculativeDecoder.discard``), so a step that raises can be
retried on a smaller batch or dropped: ``LLMEngine`` applies the updates in its commit phase, request by request.
That split is what failure isolation rests on (docs/architecture.md, "Failure isolation").
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch

from specdec.device import to_device
from specdec.engine.plain_step import plain_item, sample_plain
from specdec.engine.scheduler import ScheduledBatch
from specdec.engine.sequence import Sequence
from specdec.runner.model_runner import ForwardItem, ModelRunner
from specdec.runner.step_output import StepOutput
from specdec.sampling.logprobs import TokenLogprobs, token_logprobs
from specdec.spec_decode.decoder import DraftRound, SpeculativeDecoder
from specdec.spec_decode.verify import VerifyResult

DEVICE_DRAFT = 0  # a verification window's placeholder id for a draft that is only on the device


@dataclass
class RequestUpdate:
    """What one step computed for one request; applied by ``LLMEngine`` at commit, never before."""

    seq: Sequence
    num_computed: int  # target KV length the request keeps after the step (rollback included)
    new_tokens: list[int]  # a sampled token, or the accepted drafts + correction/bonus; [] for a mid-prompt chunk
    lookahead_granted: int | None = None  # speculation budget granted at a decode step (metrics.k_per_step)
    drafted: int = 0  # draft positions verified: a chain's length, a tree's depth
    accepted: int = 0
    verified: bool = False  # the tokens came from a verification round
    draft_forwards: int = 0
    accepted_nodes: list[int] | None = None  # a tree round: the accepted path's nodes (depth 1..accepted)
    logprobs: list[TokenLogprobs] | None = None  # one per new token when params.logprobs is set (logprobs hook)


def compute_step(batch: ScheduledBatch, runner: ModelRunner, decoder: SpeculativeDecoder | None = None,
                 observe_costs: bool = True) -> list[RequestUpdate]:
    """The updates of every request of ``batch``, in batch order.

    Args:
        decoder: the ``SpeculativeDecoder``, or None for plain decoding.
        observe_costs: time the target forward for adaptive k (False for the retried halves of a failed step).
    """
    draft_round = _draft(batch, decoder) if decoder is not None else None
    window_of = {r.seq_id: b for b, r in enumerate(draft_round.requests)} if draft_round is not None else {}
    items = [_window_item(seq, draft_round, window_of[seq.seq_id]) if seq.seq_id in window_of else plain_item(seq, n)
             for seq, n in zip(batch.seqs, batch.num_new_tokens)]
    logits_starts = list(itertools.accumulate((item.num_logits for item in items), initial=0))  # [len + 1]
    input_starts = list(itertools.accumulate((len(item.token_ids) for item in items), initial=0))
    verifying = [i for i, seq in enumerate(batch.seqs) if seq.seq_id in window_of]
    meta = None
    if verifying:
        meta = decoder.metadata(draft_round, [logits_starts[i] for i in verifying],
                                [input_starts[i] for i in verifying], logits_starts[-1], runner.device)
    input_ids = None  # int64 [T] on the device, only when some window's drafts are on the device
    if meta is not None and meta.draft_input_indices is not None:
        input_ids = meta.scatter_drafts(to_device([t for item in items for t in item.token_ids], torch.int64,
                                                  runner.device))

    start = decoder.start_target_timer(runner.device) if decoder is not None and observe_costs else None
    logits, aux_hidden = _target_forward(runner, decoder, items, input_ids)  # fp32 [R, V], R = sum(num_logits)
    if start is not None:
        decoder.observe_target(start, len(items), input_starts[-1], tree=meta is not None and meta.trees is not None)

    out = StepOutput()
    plain = [i for i, item in enumerate(items) if item.num_logits and batch.seqs[i].seq_id not in window_of]
    plain_rows = None
    if plain:
        rows = logits  # without windows every row is a plain one, in order
        if meta is not None:  # some rows are verification windows: gather the plain ones on the device
            rows = logits.index_select(0, to_device([logits_starts[i] for i in plain], torch.int64, logits.device))
        plain_rows = sample_plain(rows, [batch.seqs[i] for i in plain], out)
    pending = decoder.verify_round(logits, draft_round, meta, out) if meta is not None else None
    out.read()  # the step's one host read
    sampled = plain_rows.result() if plain_rows is not None else {}
    verified: VerifyResult | None = None
    if pending is not None:
        verified = pending.result([r.request_id for r in draft_round.requests])
        decoder.compact(draft_round, verified, runner.pool, runner.block_manager)
    if aux_hidden is not None:
        _hand_over_hidden_states(decoder, batch, input_starts, window_of, verified, aux_hidden)

    updates = [_update(seq, n, draft_round, window_of, verified, sampled)
               for seq, n in zip(batch.seqs, batch.num_new_tokens)]
    if any(seq.params.logprobs is not None for seq in batch.seqs):
        _logprobs(logits, updates, logits_starts)
    if decoder is not None:
        decoder.flush_timings()  # after the step's host read: the timed forwards have completed
    return updates


def _target_forward(runner: ModelRunner, decoder: SpeculativeDecoder | None, items: list[ForwardItem],
                    input_ids: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(logits, the hidden states an EAGLE-3 proposer reads - ``[T, 3 * H]`` for every new token - or None when
    the proposer reads none: then the forward captures nothing)."""
    layers = decoder.aux_hidden_layers if decoder is not None else None
    if layers is None:
        return runner.forward(items, input_ids=input_ids), None
    return runner.forward_with_aux_hidden(items, layers, input_ids=input_ids)


def _hand_over_hidden_states(decoder: SpeculativeDecoder, batch: ScheduledBatch, input_starts: list[int],
                             window_of: dict[int, int], verified: VerifyResult | None, aux: torch.Tensor) -> None:
    """The target's hidden states of the tokens each request keeps to the proposer (EAGLE-3): a plain item's
    (a prefill chunk, a plain decode) every token; a verification window's root and accepted path (a chain's
    first rows, a tree's accepted nodes), at positions ``num_computed`` on. One gather on the device."""
    rows, seq_ids, starts, counts = [], [], [], []
    for i, seq in enumerate(batch.seqs):
        first = input_starts[i]
        b = window_of.get(seq.seq_id)
        if b is None:
            kept = list(range(first, input_starts[i + 1]))
        elif verified.accepted_nodes is not None:
            kept = [first, *(first + node for node in verified.accepted_nodes[b])]
        else:
            kept = list(range(first, first + 1 + verified.num_accepted[b]))
        rows += kept
        seq_ids.append(seq.seq_id)
        starts.append(seq.num_computed)
        counts.append(len(kept))
    decoder.keep_hidden_states(seq_ids, starts, counts, aux.index_select(0, to_device(rows, torch.int64, aux.device)))


def _draft(batch: ScheduledBatch, decoder: SpeculativeDecoder) -> DraftRound:
    """The round's drafts for the batch's decode steps (a prefill chunk never drafts)."""
    decoding = [seq for seq, n in zip(batch.seqs, batch.num_new_tokens)
                if n == 1 and seq.num_computed + 1 == seq.num_tokens]
    return decoder.draft(decoding, [seq.lookahead for seq in decoding], len(batch.seqs))


def _window_item(seq: Sequence, draft_round: DraftRound, b: int) -> ForwardItem:
    """Request ``seq``'s verification window: its last token then its drafts (a tree: its nodes in DFS order,
    node i at RoPE position ctx + depth(i)); every row's logits are wanted."""
    proposal = draft_round.proposal
    if proposal.trees is not None:
        tree = proposal.trees[b]
        return ForwardItem(seq.seq_id, list(tree.token_ids), seq.num_computed, len(tree.token_ids),
                           positions=[seq.num_computed + depth for depth in tree.depths], mask=tree.mask())
    k = proposal.counts()[b]
    drafts = proposal.token_ids[b] if proposal.token_ids is not None else [DEVICE_DRAFT] * k
    return ForwardItem(seq.seq_id, [seq.last_token_id, *drafts], seq.num_computed, k + 1)


def _update(seq: Sequence, num_new: int, draft_round: DraftRound | None, window_of: dict[int, int],
            verified: VerifyResult | None, sampled: dict[int, list[int]]) -> RequestUpdate:
    granted = draft_round.lookahead_granted.get(seq.seq_id) if draft_round is not None else None
    forwards = draft_round.draft_forwards.get(seq.seq_id, 0) if draft_round is not None else 0
    b = window_of.get(seq.seq_id)
    if b is None:
        return RequestUpdate(seq, seq.num_computed + num_new, sampled.get(seq.seq_id, []), granted,
                             draft_forwards=forwards)
    accepted = verified.num_accepted[b]
    proposal = draft_round.proposal
    # drafted positions: a chain's length, a tree's depth (its node count is in the proposal)
    drafted = proposal.trees[b].max_depth if proposal.trees is not None else proposal.counts()[b]
    nodes = verified.accepted_nodes[b] if verified.accepted_nodes is not None else None
    return RequestUpdate(seq, seq.num_computed + 1 + accepted, verified.emitted[b], granted, drafted, accepted,
                         True, forwards, accepted_nodes=nodes)


def _logprobs(logits: torch.Tensor, updates: list[RequestUpdate], logits_starts: list[int]) -> None:
    """The logprobs hook (sampling/logprobs.py), only when a request asked: the logits row each emitted token was
    drawn from - a plain token: its item's one row; a verified chain: token j from row j of its window; a tree:
    token j from the row of the path's node at depth j (the root's for j = 0)."""
    wanted = [(u, first) for u, first in zip(updates, logits_starts) if u.seq.params.logprobs is not None
              and u.new_tokens]
    rows, tokens, top_n = [], [], []
    for u, first in wanted:
        nodes = [0, *u.accepted_nodes] if u.accepted_nodes is not None else range(len(u.new_tokens))
        rows += [first + node for node in list(nodes)[: len(u.new_tokens)]]
        tokens += u.new_tokens
        top_n += [u.seq.params.logprobs] * len(u.new_tokens)
    flat = token_logprobs(logits, rows, tokens, top_n)
    i = 0
    for u, _ in wanted:
        u.logprobs = flat[i : i + len(u.new_tokens)]
        i += len(u.new_tokens)


def undo_step(seqs: list[Sequence], decoder: SpeculativeDecoder | None = None) -> None:
    """Forget what a failed ``compute_step`` left behind: the proposer's state beyond each request's committed
    KV. (Target K/V written beyond ``num_computed`` is garbage by definition and is overwritten later.)"""
    if decoder is not None:
        decoder.discard(seqs)
