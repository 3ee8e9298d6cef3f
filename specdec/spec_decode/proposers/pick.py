"""One model-free method that picks per round, method "pick": every model-free drafter proposes, and each request
takes the proposal with the most expected accepted tokens by what each drafter's drafts measured so far.

The drafters: prompt lookup, the frequency n-gram table, recycled candidates and suffix drafting (each as its own
method describes; they keep their own state - recycle's matrix is fed by the step, suffix's index at each finish).
Per request and round each drafter proposes its chain of up to k tokens; a chain of length L from a drafter whose
drafts are accepted at rate a is worth ``a + a^2 + ... + a^L`` expected tokens, and the request drafts the best
(ties: the shorter chain, then the order above). A tree round picks the drafter the same way, from the chains, and
drafts that drafter's tree.

The rate a of drafter m for a request is its accepted / drafted tokens in this request's rounds that drafted with m,
shrunk towards m's rate over every request of the engine (``PRIOR_WEIGHT`` pseudo-drafts), which starts at
``PRIOR_RATE``. A round's outcome is read at its commit (``rollback``: the kept KV length says how many drafts were
accepted). The choice depends only on emitted tokens and earlier outcomes, never on the round's own verification,
and every drafter's drafts are one-hot: verification keeps greedy and sampled requests exact as for each drafter
alone.
"""

from __future__ import annotations

from specdec.spec_decode.proposers.base import DraftProposal, ModelFreeProposer
from specdec.spec_decode.proposers.ngram_table import NgramTableProposer
from specdec.spec_decode.proposers.prompt_lookup import PromptLookupProposer
from specdec.spec_decode.proposers.recycle import RecycleProposer
from specdec.spec_decode.proposers.suffix import SuffixProposer
from specdec.spec_decode.proposers.token_trie import check_tree_budgets
from specdec.spec_decode.request import RequestView

PRIOR_RATE = 0.5  # a drafter's acceptance before any of its drafts was verified
PRIOR_WEIGHT = 4.0  # the engine-wide rate counts as this many drafts of the request's own


def expected_tokens(rate: float, length: int) -> float:
    """``rate + rate^2 + ... + rate^length``: expected accepted tokens of a chain of ``length`` drafts."""
    return sum(rate ** i for i in range(1, length + 1))


class PickProposer(ModelFreeProposer):
    """Model-free drafter choosing per request and round among ``drafters`` (module docstring).

    Args:
        drafters: name -> model-free proposer, in tie-break order; at most one of them reads the step's candidates
            (a :class:`RecycleProposer`).
    """

    def __init__(self, drafters: dict[str, ModelFreeProposer]):
        self.drafters = drafters
        readers = [d for d in drafters.values() if d.candidate_width]
        assert len(readers) <= 1, "at most one drafter reads the step's candidates"
        self.reader = readers[0] if readers else None
        self.candidate_width = self.reader.candidate_width if self.reader is not None else None
        self.engine_counts = {name: [0, 0] for name in drafters}  # name -> [accepted, drafted] over every request
        self.request_counts: dict[int, dict[str, list[int]]] = {}  # seq id -> name -> [accepted, drafted]
        self.pending: dict[int, tuple[str, int]] = {}  # seq id -> (drafter, drafts) of its round not yet committed
        self.picks = {name: 0 for name in drafters}  # rounds each drafter was picked for (metrics, tests)

    def rate(self, seq_id: int, name: str) -> float:
        accepted, drafted = self.engine_counts[name]
        prior = (accepted + PRIOR_RATE * PRIOR_WEIGHT) / (drafted + PRIOR_WEIGHT)
        own = self.request_counts.get(seq_id, {}).get(name, (0, 0))
        return (own[0] + prior * PRIOR_WEIGHT) / (own[1] + PRIOR_WEIGHT)

    def _choose(self, seqs: list[RequestView], num_tokens: list[int]) -> tuple[list[str | None], list[list[int]]]:
        """Per request the drafter picked (None: none proposed anything) and its chain."""
        chains = {name: d.propose(seqs, num_tokens).token_ids for name, d in self.drafters.items()}
        names, drafts = [], []
        for b, seq in enumerate(seqs):
            best, best_key = None, None
            for order, name in enumerate(self.drafters):
                chain = chains[name][b]
                if not chain:
                    continue
                key = (-expected_tokens(self.rate(seq.seq_id, name), len(chain)), len(chain), order)
                if best_key is None or key < best_key:
                    best, best_key = name, key
            names.append(best)
            drafts.append(chains[best][b] if best is not None else [])
        return names, drafts

    def propose(self, seqs: list[RequestView], num_tokens: list[int]) -> DraftProposal:
        names, drafts = self._choose(seqs, num_tokens)
        self._remember(seqs, names, [len(d) for d in drafts])
        return DraftProposal(drafts, None, [True] * len(seqs))

    def propose_tree(self, seqs: list[RequestView], max_depths: list[int], max_nodes: list[int]) -> DraftProposal:
        """Per request the tree of the drafter its chain picked (``max_depths[i]`` deep, ``max_nodes[i]`` drafts)."""
        check_tree_budgets(len(seqs), max_depths, max_nodes)
        names, _ = self._choose(seqs, list(max_depths))
        trees: list = [None] * len(seqs)
        for name, drafter in self.drafters.items():
            mine = [b for b, n in enumerate(names) if n == name]
            if mine:
                proposal = drafter.propose_tree([seqs[b] for b in mine], [max_depths[b] for b in mine],
                                                [max_nodes[b] for b in mine])
                for b, tree in zip(mine, proposal.trees):
                    trees[b] = tree
        # a request nobody proposed for: the root alone (no drafts); any drafter's empty tree does
        rest = [b for b, n in enumerate(names) if n is None]
        if rest:
            empty = next(iter(self.drafters.values())).propose_tree([seqs[b] for b in rest], [0] * len(rest),
                                                                    [0] * len(rest))
            for b, tree in zip(rest, empty.trees):
                trees[b] = tree
        self._remember(seqs, names, [t.max_depth for t in trees])
        return DraftProposal([list(t.token_ids[1:]) for t in trees], None, [True] * len(seqs), trees=trees)

    def _remember(self, seqs: list[RequestView], names: list[str | None], lengths: list[int]) -> None:
        for seq, name, length in zip(seqs, names, lengths):
            if name is not None and length:
                self.pending[seq.seq_id] = (name, length)
                self.picks[name] += 1

    def take_candidates(self, seq_ids: list[int], tokens: list[int], candidates: list[list[int]]) -> None:
        if self.reader is not None:
            self.reader.take_candidates(seq_ids, tokens, candidates)

    def rollback(self, request: RequestView, kv_len: int) -> None:
        """The round committed ``kv_len`` tokens of KV: ``kv_len - num_computed - 1`` of its drafts were accepted."""
        pending = self.pending.pop(request.seq_id, None)
        if pending is None:
            return
        name, drafted = pending
        accepted = max(0, min(drafted, kv_len - request.num_computed - 1))
        for counts in (self.engine_counts[name], self.request_counts.setdefault(request.seq_id, {}).setdefault(
                name, [0, 0])):
            counts[0] += accepted
            counts[1] += drafted

    def discard(self, request: RequestView, kv_len: int) -> None:
        self.pending.pop(request.seq_id, None)  # the failed step's round never happened

    def free(self, seq_id: int, finished: bool) -> None:
        for drafter in self.drafters.values():
            drafter.free(seq_id, finished)
        self.pending.pop(seq_id, None)
        if finished:
            self.request_counts.pop(seq_id, None)


def build_pick(vocab_size: int, prompt_lookup: tuple[int, int], ngram: tuple[int, int, int], recycle_width: int,
               recycle_scope: str, suffix_max_tokens: int, suffix_scope: str) -> PickProposer:
    """The "pick" proposer over the four model-free drafters with these options (``SpeculativeConfig``'s)."""
    return PickProposer({
        "prompt_lookup": PromptLookupProposer(*prompt_lookup),
        "ngram_table": NgramTableProposer(*ngram),
        "recycle": RecycleProposer(vocab_size, recycle_width, recycle_scope),
        "suffix": SuffixProposer(suffix_max_tokens, suffix_scope),
    })
