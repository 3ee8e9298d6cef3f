"""Prompt-lookup drafter: copy what followed earlier occurrences of the text's own suffix.

A **match** is an earlier position where the last n tokens of prompt + output occurred before (never the suffix
itself), ``min_ngram <= n <= max_ngram``; its continuation is what followed it. Matches rank by length (longer
first), then recency (later first).

- ``propose`` (chain): the continuation of the best match - the most recent occurrence of the longest matching
  suffix - up to k tokens. (vLLM calls this method "ngram"; our frequency-table predictor is "ngram_table",
  ngram_table.py.)
- ``propose_tree`` (token trie): the continuations of the best ``max_matches`` matches (all lengths), merged by
  shared prefixes. A node's **support** is the number of matches whose continuation passes through it; siblings
  are ordered by support (ties: the most recent match first) and the budget keeps the best-supported nodes, after
  the chain's own path, which is always kept when the budget holds it (``token_trie.best_first_tree``).
"""

from __future__ import annotations

import numpy as np

from specdec.spec_decode.proposers.base import DraftProposal, ModelFreeProposer
from specdec.spec_decode.proposers.token_trie import check_tree_budgets, support_trie, tree_proposal
from specdec.spec_decode.request import RequestView
from specdec.spec_decode.tree import DraftTree


def lookup_matches(tokens: np.ndarray, min_ngram: int, max_ngram: int, max_matches: int | None = None,
                   token_list: list[int] | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Earlier matches of the suffix of ``tokens`` (int64 ``[L]``; ``token_list``: the same as a list, if at hand).

    Returns ``(starts, lengths)``, int64 ``[M]`` each: ``starts[i]`` is where match i's continuation begins
    (``tokens[starts[i] - n : starts[i]]`` equals the last n tokens, ``n = lengths[i]``, ``starts[i] <= L - 1``),
    ordered by length descending, then start descending; at most ``max_matches`` of them. Work is one pass over
    the text plus O(occurrences of the last token * max_ngram).
    """
    length = tokens.size
    if length < max(min_ngram, 1) + 1 or max_ngram < 1:
        empty = np.zeros(0, dtype=np.int64)
        return empty, empty
    starts = np.flatnonzero(tokens[: length - 1] == tokens[length - 1]) + 1  # [M] matches of the last token
    span = min(max_ngram, length - 1)
    if starts.size <= _PY_EXTEND_MAX:  # few candidates: a Python loop beats a dozen numpy calls
        if token_list is None:
            token_list = tokens.tolist()
        lengths = np.asarray(_match_lengths_py(token_list, starts.tolist(), span), dtype=np.int64)
    else:
        lengths = _match_lengths_np(tokens, starts, span)
    keep = lengths >= min_ngram
    starts, lengths = starts[keep], lengths[keep]
    order = np.lexsort((-starts, -lengths))[:max_matches]  # primary: longer; then: more recent
    return starts[order], lengths[order]


_PY_EXTEND_MAX = 64  # candidates up to which match lengths are measured in Python


def _match_lengths_py(tokens: list[int], starts: list[int], span: int) -> list[int]:
    """Per candidate start (``tokens[start - 1] == tokens[-1]``), how many tokens before it match the text's
    last ones, up to ``span``."""
    last = len(tokens) - 1
    out = []
    for start in starts:
        n = 1
        while n < span and start - n - 1 >= 0 and tokens[start - n - 1] == tokens[last - n]:
            n += 1
        out.append(n)
    return out


def _match_lengths_np(tokens: np.ndarray, starts: np.ndarray, span: int) -> np.ndarray:
    """``_match_lengths_py`` vectorised over the candidates (int64 ``[M]``)."""
    length = tokens.size
    back = np.arange(1, span + 1)  # [span] 1, 2, ..: offsets back from a match end / the text's end
    before = starts[:, None] - back  # [M, span] positions compared with tokens[length - back]
    # eq[m, j]: the (j+1)-th token before match m equals the (j+1)-th last token (false before the text start)
    eq = (tokens[np.maximum(before, 0)] == tokens[length - back]) & (before >= 0)  # bool [M, span]
    return np.logical_and.accumulate(eq, axis=1).sum(axis=1)  # eq[:, 0] is true by construction


def prompt_lookup(tokens: list[int], k: int, min_ngram: int, max_ngram: int,
                  array: np.ndarray | None = None) -> list[int]:
    """Up to ``k`` tokens that followed the most recent earlier match of the longest matching suffix.
    ``array``: ``tokens`` as int64 ``[L]`` if the caller keeps one (saves the conversion)."""
    if k <= 0:
        return []
    if array is None:
        array = np.asarray(tokens, dtype=np.int64)
    starts, _ = lookup_matches(array, min_ngram, max_ngram, max_matches=1, token_list=tokens)
    if not starts.size:
        return []
    start = int(starts[0])
    return tokens[start : start + k]


def prompt_lookup_tree(tokens: list[int], max_depth: int, max_nodes: int, min_ngram: int, max_ngram: int,
                       max_matches: int = 64, array: np.ndarray | None = None, keep_chain: bool = True) -> DraftTree:
    """The token trie of the continuations of the best ``max_matches`` matches (see the module docstring).

    Root = ``tokens[-1]``; depth ``<= max_depth``; at most ``max_nodes`` drafted nodes; the chain
    ``prompt_lookup(tokens, max_depth, ...)`` is a root-to-node path whenever ``max_nodes`` holds it.
    ``array``: as for :func:`prompt_lookup`. ``keep_chain=False``: no node is kept first, the budget goes to the
    best-supported nodes only.
    """
    root = tokens[-1]
    if max_depth <= 0 or max_nodes <= 0:
        return DraftTree((root,), (-1,))
    if array is None:
        array = np.asarray(tokens, dtype=np.int64)
    starts, _ = lookup_matches(array, min_ngram, max_ngram, max_matches, token_list=tokens)
    if not starts.size:
        return DraftTree((root,), (-1,))
    # distinct continuations -> [matches, most recent start] (repetitive text repeats its continuations)
    conts: dict[tuple[int, ...], list[int]] = {}
    for start in starts.tolist():
        cont = tuple(tokens[start : start + max_depth])
        seen = conts.get(cont)
        if seen is None:
            conts[cont] = [1, start]
        else:
            seen[0] += 1
            seen[1] = max(seen[1], start)  # matches arrive longest first, not latest first
    chain = tokens[int(starts[0]) : int(starts[0]) + max_depth]
    if len(conts) == 1:  # every match agrees: the tree is the chain
        return DraftTree.chain(root, chain[:max_nodes])
    # the trie: a node's support is the matches through it; ties go to the most recent match start
    return support_trie(root, [(cont, count, -start) for cont, (count, start) in conts.items()], max_depth,
                        max_nodes, chain if keep_chain else ())


class PromptLookupProposer(ModelFreeProposer):
    def __init__(self, min_ngram: int = 2, max_ngram: int = 4, max_matches: int = 64, keep_chain: bool = True):
        if max_matches < 1:
            raise ValueError(f"max_matches (matches merged into a tree) must be >= 1, got {max_matches}")
        self.min_ngram, self.max_ngram, self.max_matches = min_ngram, max_ngram, max_matches
        self.keep_chain = keep_chain  # trees keep propose()'s chain first (prompt_lookup_tree)

    def propose(self, seqs: list[RequestView], num_tokens: list[int]) -> DraftProposal:
        drafts = [prompt_lookup(seq.all_token_ids, k, self.min_ngram, self.max_ngram, seq.token_array)
                  for seq, k in zip(seqs, num_tokens)]
        return DraftProposal(drafts, None, [True] * len(seqs))

    def propose_tree(self, seqs: list[RequestView], max_depths: list[int], max_nodes: list[int]) -> DraftProposal:
        """Per request a token trie (depth ``<= max_depths[i]``, ``<= max_nodes[i]`` drafts); one-hot, no q."""
        check_tree_budgets(len(seqs), max_depths, max_nodes)
        trees = []
        for seq, depth, nodes in zip(seqs, max_depths, max_nodes):
            trees.append(prompt_lookup_tree(seq.all_token_ids, depth, nodes, self.min_ngram, self.max_ngram,
                                            self.max_matches, seq.token_array, self.keep_chain))
        return tree_proposal(trees)

    def free(self, seq_id: int, finished: bool) -> None:
        pass  # no per-request state: the request keeps its own history
