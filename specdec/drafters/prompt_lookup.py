"""Prompt-lookup drafter: copy what followed earlier occurrences of the text's own suffix.

A **match** is an earlier position where the last n tokens of prompt + output occurred before (never the suffix
itself), ``min_ngram <= n <= max_ngram``; its continuation is what followed it. Matches rank by length (longer
first), then recency (later first).

- ``propose`` (chain): the continuation of the best match - the most recent occurrence of the longest matching
  suffix - up to k tokens. (vLLM calls this method "ngram"; here "ngram" is the frequency-table predictor in
  ngram.py.)
- ``propose_tree`` (token trie): the continuations of the best ``max_matches`` matches (all lengths), merged by
  shared prefixes. A node's **support** is the number of matches whose continuation passes through it; siblings
  are ordered by support (ties: the most recent match first) and the budget keeps the best-supported nodes, after
  the chain's own path, which is always kept when the budget holds it (``token_trie.best_first_tree``).
"""

from __future__ import annotations

import numpy as np

from specdec.drafters.base import DraftProposal
from specdec.drafters.token_trie import best_first_tree, check_tree_budgets, tree_proposal
from specdec.drafters.tree import DraftTree
from specdec.engine.sequence import Sequence


def lookup_matches(tokens: np.ndarray, min_ngram: int, max_ngram: int,
                   max_matches: int | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Earlier matches of the suffix of ``tokens`` (int64 ``[L]``), best first.

    Returns ``(starts, lengths)``, int64 ``[M]`` each: ``starts[i]`` is where match i's continuation begins
    (``tokens[starts[i] - n : starts[i]]`` equals the last n tokens, ``n = lengths[i]``, ``starts[i] <= L - 1``),
    ordered by length descending, then start descending; at most ``max_matches`` of them. Work is
    O(occurrences of the last token * max_ngram).
    """
    length = tokens.size
    if length < min_ngram + 1 or max_ngram < 1:
        empty = np.zeros(0, dtype=np.int64)
        return empty, empty
    starts = np.flatnonzero(tokens[: length - 1] == tokens[length - 1]) + 1  # [M] matches of the last token
    lengths = np.ones(starts.size, dtype=np.int64)
    alive = np.ones(starts.size, dtype=bool)
    for j in range(2, max_ngram + 1):
        if j >= length:
            break
        ok = alive & (starts >= j)
        ok[ok] = tokens[starts[ok] - j] == tokens[length - j]
        alive = ok
        if not alive.any():
            break
        lengths += alive
    keep = lengths >= min_ngram
    starts, lengths = starts[keep], lengths[keep]
    order = np.lexsort((-starts, -lengths))[:max_matches]  # primary: longer; then: more recent
    return starts[order], lengths[order]


def prompt_lookup(tokens: list[int], k: int, min_ngram: int, max_ngram: int) -> list[int]:
    """Up to ``k`` tokens that followed the most recent earlier match of the longest matching suffix."""
    if k <= 0:
        return []
    starts, _ = lookup_matches(np.asarray(tokens, dtype=np.int64), min_ngram, max_ngram, max_matches=1)
    if not starts.size:
        return []
    start = int(starts[0])
    return tokens[start : start + k]


def prompt_lookup_tree(tokens: list[int], max_depth: int, max_nodes: int, min_ngram: int, max_ngram: int,
                       max_matches: int = 64) -> DraftTree:
    """The token trie of the continuations of the best ``max_matches`` matches (see the module docstring).

    Root = ``tokens[-1]``; depth ``<= max_depth``; at most ``max_nodes`` drafted nodes; the chain
    ``prompt_lookup(tokens, max_depth, ...)`` is a root-to-node path whenever ``max_nodes`` holds it.
    """
    root = tokens[-1]
    if max_depth <= 0 or max_nodes <= 0:
        return DraftTree((root,), (-1,))
    starts, _ = lookup_matches(np.asarray(tokens, dtype=np.int64), min_ngram, max_ngram, max_matches)
    # the trie: node -> {token: child}; per node its support (matches through it) and most recent match start
    children: list[dict[int, int]] = [{}]
    support, recency, token_of = [0], [-1], [root]
    for start in starts.tolist():
        node = 0
        for token in tokens[start : start + max_depth]:
            child = children[node].get(token)
            if child is None:
                child = children[node][token] = len(token_of)
                children.append({})
                support.append(0)
                recency.append(start)
                token_of.append(token)
            support[child] += 1
            recency[child] = max(recency[child], start)  # matches arrive longest first, not latest first
            node = child

    def expand(node: int) -> list[tuple[int, tuple, int]]:
        kids = [(tok, (support[c], recency[c]), c) for tok, c in children[node].items()]
        kids.sort(key=lambda kid: kid[1], reverse=True)  # sibling recencies differ: a total order
        return kids

    chain = tokens[int(starts[0]) : int(starts[0]) + max_depth] if starts.size else []
    return best_first_tree(root, 0, expand, max_depth, max_nodes, chain)


class PromptLookupDrafter:
    def __init__(self, min_ngram: int = 2, max_ngram: int = 4, max_matches: int = 64):
        self.min_ngram, self.max_ngram, self.max_matches = min_ngram, max_ngram, max_matches

    def propose(self, seqs: list[Sequence], num_tokens: list[int]) -> DraftProposal:
        drafts = [prompt_lookup(s.all_token_ids, k, self.min_ngram, self.max_ngram) for s, k in zip(seqs, num_tokens)]
        return DraftProposal(drafts, None, [True] * len(seqs))

    def propose_tree(self, seqs: list[Sequence], max_depths: list[int], max_nodes: list[int]) -> DraftProposal:
        """Per request a token trie (depth ``<= max_depths[i]``, ``<= max_nodes[i]`` drafts); one-hot, no q."""
        check_tree_budgets(len(seqs), max_depths, max_nodes)
        trees = [prompt_lookup_tree(s.all_token_ids, d, n, self.min_ngram, self.max_ngram, self.max_matches)
                 for s, d, n in zip(seqs, max_depths, max_nodes)]
        return tree_proposal(trees)

    def rollback(self, seq: Sequence, kv_len: int) -> None:
        pass

    def free(self, seq: Sequence) -> None:
        pass
