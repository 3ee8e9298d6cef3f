"""A model-free drafter's chains fitted to each request's grammar, and the text a grammar forces drafted for free.

Where the grammar admits exactly one continuation (a JSON key, punctuation, the rest of an enum value), its tokens
(llguidance's fast-forward tokens: the canonical tokenisation of the forced text) become the request's draft -
jump-forward decoding as speculation. A text has several tokenisations and the target may prefer another, so the
forced tokens are verified like any draft. Drafts the grammar refuses are cut first (a deterministic function of
the context, like the drafts themselves, so verification stays lossless); of the two, the longer chain is kept.

Only host, one-hot chains are fitted (prompt lookup, the n-gram table); a draft model's chains are drawn from q
masked by the grammar already (``chain_drafting.sample_draft_step``), and trees are left as they are.
"""

from __future__ import annotations

import dataclasses

from specdec.spec_decode.proposers.base import DraftProposal
from specdec.spec_decode.request import RequestView

# False: model-free chains are only cut to the grammar, no forced text is drafted (bench/speed/structured.py times
# both; not a user setting)
FORCED_TEXT = True


def fit_to_grammar(proposal: DraftProposal | None, requests: list[RequestView], depths: list[int]
                   ) -> DraftProposal | None:
    """``proposal`` (for ``requests``, each asked for ``depths[i]`` drafts) with every constrained request's chain
    cut to its grammar's valid prefix, or replaced by the grammar's forced tokens where those are longer."""
    if proposal is None:
        drafts = [[] for _ in requests]
        proposal = DraftProposal(drafts, None, [True] * len(requests))
    elif (proposal.trees is not None or proposal.token_ids is None or proposal.probs is not None
          or proposal.device_ids is not None):
        return proposal
    drafts = []
    for request, chain, depth, onehot in zip(requests, proposal.token_ids, depths, proposal.is_onehot):
        grammar = request.grammar
        if grammar is None or not onehot or grammar.finished:
            drafts.append(chain)
            continue
        valid = chain[: grammar.valid_prefix(chain)] if chain else []
        forced = grammar.forced_tokens()[:depth] if FORCED_TEXT else []
        outside = next((j for j, t in enumerate(forced) if t >= grammar.vocab_size), len(forced))
        forced = forced[:outside]  # a tokenizer's added ids beyond the model's vocabulary are never drafted
        drafts.append(forced if len(forced) > len(valid) else valid)
    if not any(drafts):
        return None
    return dataclasses.replace(proposal, token_ids=drafts, num_drafts=None)
