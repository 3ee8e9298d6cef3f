"""Chains from a model drafter (a draft model, an EAGLE-3 head): k batched draft steps, no host read.

The drafter is anything with :class:`~specdec.spec_decode.proposers.model_drafter.ModelDrafter`'s members; this
module reads nothing else of it.
"""

from __future__ import annotations

import numpy as np
import torch

from specdec.device import to_device
from specdec.kernels.philox import STREAM_DRAFT, round_stream
from specdec.sampling.sampler import sample_rows
from specdec.spec_decode.proposers.base import DraftProposal
from specdec.spec_decode.proposers.draft_vocab import DraftVocab, q_over_target
from specdec.spec_decode.proposers.model_drafter import ModelDrafter
from specdec.spec_decode.request import RequestView
from specdec.structured.masking import mask_logits


def draft_chains(drafter: ModelDrafter, seqs: list[RequestView], num_tokens: list[int]) -> DraftProposal:
    """Chains of ``num_tokens[i]`` drafts for ``seqs[i]`` from a model drafter (a draft model, an EAGLE-3 head),
    batched: k steps, each one forward (``drafter.chain_step``) over the requests still drafting. No host read:
    the drafted ids stay on the device (``DraftProposal.device_ids``, with the NaN/inf flags of every step in
    ``bad_rows``) through the target forward, and come to the host with the verification result - unless a
    request uses penalties or a grammar: their context needs the drafts so far on the host, so then each step reads
    its tokens (``token_ids`` is then filled too). A request with a grammar draws from q masked by its grammar
    state after the drafts so far, so its drafts stay in the grammar. q rows are laid out over the target's
    vocabulary."""
    step_tokens: list[torch.Tensor] = []  # per step: int64 [len(active)] drafted ids, on the device
    step_probs: list[torch.Tensor | None] = []  # per step: fp32 [len(active), W] q (W: logits' width), None: greedy
    owners: list[int] = []  # request of each row of torch.cat(step_tokens)
    bad_rows: list[torch.Tensor] = []  # per step: bool [len(active)] rows with NaN/inf draft logits
    # penalties and grammars read the drafts so far on the host: then each step reads its tokens
    host_drafts = [[] for _ in seqs] if any(s.params.needs_host_drafts for s in seqs) else None
    active = [i for i, k in enumerate(num_tokens) if k > 0]
    input_ids = None  # after step 0: the previous step's drafts, still on the device
    kept = None  # after step 0: rows of the previous step still drafting (int64 on the device; None: all)
    step = 0
    while active:
        logits = drafter.chain_step(seqs, active, step, input_ids, kept)  # (len(active), W)
        tokens, probs = drafter.sample_step(logits, [seqs[i] for i in active], step,
                                            [host_drafts[i] for i in active] if host_drafts else None, bad_rows)
        step_tokens.append(tokens)
        step_probs.append(probs)
        owners += active
        if host_drafts is not None:
            for i, t in zip(active, tokens.tolist()):  # penalties need the drafts on the host every step
                host_drafts[i].append(t)
        step += 1
        if (step == 1 and host_drafts is None and len({num_tokens[i] for i in active}) == 1
                and num_tokens[active[0]] > 1):
            # every request drafts the same k: steps 1 .. k-1 as one program (a CUDA graph), when the drafter can
            rest = drafter.pure_steps(seqs, active, tokens, num_tokens[active[0]] - 1)
            if rest is not None:
                for j in range(rest.tokens.shape[1]):
                    step_tokens.append(rest.tokens[:, j])
                    step_probs.append(None if rest.probs is None else rest.probs[:, j])
                    bad_rows.append(rest.bad_rows[:, j])
                    owners += active
                break
        keep = [row for row, i in enumerate(active) if num_tokens[i] > step]
        active = [active[row] for row in keep]
        kept = None if len(keep) == len(tokens) else to_device(keep, torch.int64, tokens.device)
        input_ids = tokens if kept is None else tokens[kept]
    counts = [0] * len(seqs)
    for i in owners:
        counts[i] += 1
    order = sorted(range(len(owners)), key=owners.__getitem__)  # stable: a request's rows stay in step order
    index = to_device(order, torch.int64, drafter.runner.device)  # step-major rows -> request-major
    device_ids = _gather_rows(step_tokens, index, torch.int64)
    bad = _gather_rows(bad_rows, index, torch.bool)
    is_onehot = [seq.params.is_greedy for seq in seqs]  # greedy drafts are deterministic: q is one-hot
    probs = None
    if any(q is not None for q in step_probs):  # some request samples: q of every row, request-major
        # [sum(k_b), V_target]; a smaller draft vocabulary is zero-padded, a reduced one scattered; the rows of
        # one-hot (greedy) requests are never read (zeros where a step had only greedy rows)
        width = next(q for q in step_probs if q is not None).shape[1]
        rows = [q if q is not None else t.new_zeros(t.shape[0], width, dtype=torch.float32)
                for q, t in zip(step_probs, step_tokens)]
        probs = torch.cat(rows)[index]  # [sum(k_b), W]
        probs = q_over_target(probs, drafter.draft_vocab, drafter.target_vocab_size)  # [sum(k_b), V_target]
    # request i took part in one draft forward per draft token (the first includes its catch-up)
    return DraftProposal(host_drafts, probs, is_onehot, counts, device_ids=device_ids, bad_rows=bad,
                         num_drafts=counts)


def sample_draft_step(logits: torch.Tensor, seqs: list[RequestView], step: int, drafts: list[list[int]] | None,
                      bad_rows: list[torch.Tensor], noise_per_round: bool, vocab: DraftVocab | None = None
                      ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Draw the next draft token of each row from q, the draft distribution (``to_probs``) (same transform and the
    same penalty context - prompt + output + earlier drafts - and the same grammar mask as the target's p).
    ``drafts``: the drafts so far on the host, needed only for penalties and grammars (None otherwise). NaN/inf
    rows are reported into ``bad_rows``, not raised, so that the check costs no host read here.
    ``noise_per_round``: see ``DraftModelProposer``. ``vocab``: ``logits`` are over a reduced draft vocabulary's
    columns ``[R, |S|]``: the penalty contexts and grammar masks are mapped onto them and the drafted columns back
    to target ids. Returns (target ids int64 ``[R]``, q fp32 ``[R, W]`` over the logits' columns or None)."""
    contexts = ([s.penalty_counts(d) if s.params.has_penalties else None for s, d in zip(seqs, drafts)]
                if drafts is not None else [None] * len(seqs))
    if vocab is not None:
        contexts = [vocab.context(c) for c in contexts]
    constrained = [r for r, s in enumerate(seqs) if s.grammar is not None]
    if constrained:  # q masked as p will be: the grammar state after output + the drafts so far
        allowed = np.stack([seqs[r].grammar.allowed_after(drafts[r]) for r in constrained])  # [N, V_target]
        allowed = allowed[:, vocab.host_ids] if vocab is not None else allowed[:, : logits.shape[1]]
        with torch.inference_mode():
            logits = logits.clone()  # the drafter's own logits stay as they were
        mask_logits(logits, constrained, allowed)
    tokens, probs = sample_rows(
        logits,
        [s.params for s in seqs],
        [s.seed for s in seqs],
        [s.num_tokens + (0 if noise_per_round else step) for s in seqs],
        contexts,  # ids beyond the draft's vocabulary are dropped (they have no logit to penalise)
        round_stream(STREAM_DRAFT, step) if noise_per_round else STREAM_DRAFT,
        bad_rows=bad_rows,
    )
    return (vocab.to_target(tokens) if vocab is not None else tokens), probs


def _gather_rows(step_rows: list[torch.Tensor], index: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``torch.cat(step_rows)[index]`` (the rows of every step, in request order); no host read."""
    return torch.cat(step_rows)[index] if step_rows else torch.zeros(0, dtype=dtype, device=index.device)
