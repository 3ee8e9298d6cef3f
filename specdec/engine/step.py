"""One engine step, computed without changing any request: (draft) -> one ragged target forward -> sample / verify.

This is the one code path of a step, plain or speculative: a plain engine is a speculative one whose requests
never draft. The calls a speculative step makes (docs/architecture.md, "One step"):

    Speculator.draft              -> SpeculativeRound    which requests verify, their drafts
    round.window / plain_item     -> ForwardItems        one per request: a verification window or a plain chunk
    round.place                   -> input ids           the round's metadata, once the forward is laid out
    ModelRunner.forward           -> logits [R, V]       (timed by the policy for adaptive k)
    (top-k of every row)                                 method "recycle" only: its candidates, read with the step
    mask_step_logits                                     structured outputs: each row masked by its grammar
    sample_plain / round.verify                          queued on the device, registered in the step's StepOutput
    StepOutput.read                                      the step's one host read
    round.read                    -> VerifyResult        -> a RequestUpdate per request

``compute_step`` returns a :class:`RequestUpdate` per request and mutates no ``Sequence`` and no committed KV (the
draft model's cache is written beyond the draft's valid length; ``Speculator.discard`` forgets it), so a step
that raises can be retried on a smaller batch or dropped: ``LLMEngine`` applies the updates in its commit phase,
request by request - a verified round's KV edit (accepted path moved, both caches cut) included
(``Speculator.finish_round``). That split is what failure isolation rests on (docs/architecture.md, "Failure
isolation").
"""

from __future__ import annotations

import contextlib
import itertools
from dataclasses import dataclass

import torch

from specdec.device import StepOutput, to_device
from specdec.engine.grammar_masks import mask_step_logits
from specdec.engine.plain_step import plain_item, sample_plain
from specdec.engine.scheduler import ScheduledBatch
from specdec.engine.sequence import Sequence
from specdec.runner.model_runner import ForwardItem, ModelRunner
from specdec.sampling.logprobs import TokenLogprobs, token_logprobs
from specdec.spec_decode.round import SpeculativeRound
from specdec.spec_decode.speculator import Speculator


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


def compute_step(batch: ScheduledBatch, runner: ModelRunner, speculator: Speculator | None = None,
                 observe_costs: bool = True) -> list[RequestUpdate]:
    """The updates of every request of ``batch``, in batch order.

    Args:
        speculator: the engine's ``Speculator``, or None for plain decoding.
        observe_costs: time the step for adaptive k (False for the retried halves of a failed step).
    """
    timing = speculator.policy.timing(runner.device, observe_costs) if speculator else contextlib.nullcontext()
    with timing as timed:  # on exit (after the host read) the step's timings go to the cost model
        spec_round = _draft(batch, speculator, timed) if speculator is not None else None
        verifying = spec_round.index if spec_round is not None else {}
        items = [spec_round.window(seq) if seq.seq_id in verifying else plain_item(seq, n)
                 for seq, n in zip(batch.seqs, batch.num_new_tokens)]
        logits_starts = list(itertools.accumulate((item.num_logits for item in items), initial=0))  # [len + 1]
        input_starts = list(itertools.accumulate((len(item.token_ids) for item in items), initial=0))
        windows = [i for i, seq in enumerate(batch.seqs) if seq.seq_id in verifying]
        input_ids = None  # int64 [T] on the device, only when some window's drafts are only on the device
        if windows:
            input_ids = spec_round.place([logits_starts[i] for i in windows], [input_starts[i] for i in windows],
                                         logits_starts[-1], [t for item in items for t in item.token_ids],
                                         runner.device)

        tree = bool(windows) and spec_round.is_tree
        forward = timed.target(len(items), input_starts[-1], tree) if timed else contextlib.nullcontext()
        with forward:
            logits, aux_hidden = _target_forward(runner, speculator, items, input_ids)  # fp32 [R, V]
        out = StepOutput()
        width = speculator.proposer.candidate_width if speculator is not None else None
        # recycled candidates: the top-W ids of every row, before any grammar mask, read with the step
        candidates = out.add(torch.topk(logits, width, dim=-1).indices.flatten()) if width else None
        if any(seq.grammar is not None for seq in batch.seqs):  # structured outputs: p is the constrained one
            mask_step_logits(logits, batch.seqs, items, logits_starts, spec_round)

        plain = [i for i, item in enumerate(items) if item.num_logits and batch.seqs[i].seq_id not in verifying]
        plain_rows = None
        if plain:
            rows = logits  # without windows every row is a plain one, in order
            if windows:  # some rows are verification windows: gather the plain ones on the device
                rows = logits.index_select(0, to_device([logits_starts[i] for i in plain], torch.int64,
                                                        logits.device))
            plain_rows = sample_plain(rows, [batch.seqs[i] for i in plain], out)
        if windows:
            spec_round.verify(logits, out)
        out.read()  # the step's one host read
        sampled = plain_rows.result() if plain_rows is not None else {}
        if windows:
            spec_round.read()
        if aux_hidden is not None:
            _hand_over_hidden_states(speculator, batch, input_starts, spec_round, aux_hidden)
        if candidates is not None:
            _hand_over_candidates(speculator, batch.seqs, items, out.get(candidates))

    updates = [_update(seq, n, spec_round, sampled) for seq, n in zip(batch.seqs, batch.num_new_tokens)]
    if any(seq.params.logprobs is not None for seq in batch.seqs):
        _logprobs(logits, updates, logits_starts)
    return updates


def _draft(batch: ScheduledBatch, speculator: Speculator, timed) -> SpeculativeRound:
    """The round of the batch's decode steps (a prefill chunk never drafts)."""
    decoding = [seq for seq, n in zip(batch.seqs, batch.num_new_tokens)
                if n == 1 and seq.num_computed + 1 == seq.num_tokens]
    return speculator.draft(decoding, [seq.lookahead for seq in decoding], len(batch.seqs), timed)


def _target_forward(runner: ModelRunner, speculator: Speculator | None, items: list[ForwardItem],
                    input_ids: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(logits, the hidden states the proposer reads - ``[T, len(layers) * H]`` for every new token - or None when
    it reads none: then the forward captures nothing)."""
    layers = speculator.proposer.aux_hidden_layers if speculator is not None else None
    if layers is None:
        return runner.forward(items, input_ids=input_ids), None
    return runner.forward_with_aux_hidden(items, layers, input_ids=input_ids)


def _hand_over_hidden_states(speculator: Speculator, batch: ScheduledBatch, input_starts: list[int],
                             spec_round: SpeculativeRound, aux: torch.Tensor) -> None:
    """The target's hidden states of the tokens each request keeps to the proposer (EAGLE-3): a plain item's
    (a prefill chunk, a plain decode) every token; a verification window's root and accepted path, at positions
    ``num_computed`` on. One gather on the device."""
    rows, seq_ids, starts, counts = [], [], [], []
    for i, seq in enumerate(batch.seqs):
        first = input_starts[i]
        b = spec_round.index.get(seq.seq_id)
        kept = (list(range(first, input_starts[i + 1])) if b is None
                else [first + row for row in spec_round.kept_rows(b)])
        rows += kept
        seq_ids.append(seq.seq_id)
        starts.append(seq.num_computed)
        counts.append(len(kept))
    hidden = aux.index_select(0, to_device(rows, torch.int64, aux.device))
    speculator.proposer.take_hidden_states(seq_ids, starts, counts, hidden)


def _hand_over_candidates(speculator: Speculator, seqs: list[Sequence], items: list[ForwardItem],
                          flat: list[int]) -> None:
    """The top-W ids of every logits row (``flat``: ``[R * W]``, row-major) to the proposer, with the request and
    the input token of each row: an item's rows are its last ``num_logits`` tokens (a window: every row)."""
    seq_ids, tokens = [], []
    for seq, item in zip(seqs, items):
        if item.num_logits:
            seq_ids += [seq.seq_id] * item.num_logits
            tokens += item.token_ids[len(item.token_ids) - item.num_logits:]
    width = speculator.proposer.candidate_width
    speculator.proposer.take_candidates(seq_ids, tokens, [flat[i * width:(i + 1) * width] for i in range(len(tokens))])


def _update(seq: Sequence, num_new: int, spec_round: SpeculativeRound | None,
            sampled: dict[int, list[int]]) -> RequestUpdate:
    granted = spec_round.lookahead_granted.get(seq.seq_id) if spec_round is not None else None
    forwards = spec_round.draft_forwards.get(seq.seq_id, 0) if spec_round is not None else 0
    b = spec_round.index.get(seq.seq_id) if spec_round is not None else None
    if b is None:
        return RequestUpdate(seq, seq.num_computed + num_new, sampled.get(seq.seq_id, []), granted,
                             draft_forwards=forwards)
    result = spec_round.result
    accepted = result.num_accepted[b]
    nodes = result.accepted_nodes[b] if result.accepted_nodes is not None else None
    return RequestUpdate(seq, seq.num_computed + 1 + accepted, result.emitted[b], granted, spec_round.drafted[b],
                         accepted, True, forwards, accepted_nodes=nodes)


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


def undo_step(seqs: list[Sequence], speculator: Speculator | None = None) -> None:
    """Forget what a failed ``compute_step`` left behind: the proposer's state beyond each request's committed
    KV. (Target K/V written beyond ``num_computed`` is garbage by definition and is overwritten later.)"""
    if speculator is not None:
        speculator.discard(seqs)
