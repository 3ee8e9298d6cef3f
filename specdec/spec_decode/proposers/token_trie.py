"""Best-first selection of a model-free draft tree under a node budget, with one chain kept by construction.

The model-free drafters (prompt lookup, n-gram) describe their candidates as an implicit trie: from a node's
state, ``expand(state)`` lists the node's candidate children as ``(token, rank, child_state)``, best first. A
rank is a tuple of numbers that orders nodes across the whole tree (lower = more likely: a negated match count,
a negated path probability) and never decreases from a parent to its children, so a best-first expansion from
the root keeps the best-ranked connected set of nodes: a node is kept only if its parent is.

One path - the drafter's own chain, what ``propose()`` returns - is kept first, so a tree never loses the
chain's candidate when the budget holds it: greedy tree verification then accepts at least as many tokens as
chain verification of the same depth.
"""

from __future__ import annotations

import heapq
import numbers
from collections.abc import Callable, Hashable
from collections.abc import Sequence as Seq
from typing import Any

from specdec.spec_decode.proposers.base import DraftProposal
from specdec.spec_decode.tree import DraftTree

Rank = tuple  # numbers, compared lexicographically; lower = kept first and tried first
Expand = Callable[[Any], list[tuple[int, Rank, Any]]]


def check_tree_budgets(num_seqs: int, max_depths: Seq[int], max_nodes: Seq[int]) -> None:
    """ValueError unless there is one non-negative depth and node budget per request."""
    if len(max_depths) != num_seqs or len(max_nodes) != num_seqs:
        raise ValueError(f"propose_tree needs one max_depth and one max_nodes per request: got {num_seqs} "
                         f"requests, {len(max_depths)} max_depths, {len(max_nodes)} max_nodes")
    for name, values in (("max_depths", max_depths), ("max_nodes", max_nodes)):
        bad = [v for v in values if not isinstance(v, numbers.Integral) or isinstance(v, bool) or v < 0]
        if bad:
            raise ValueError(f"{name} must be non-negative integers, got {bad[0]!r}")


def tree_proposal(trees: list[DraftTree]) -> DraftProposal:
    """The one-hot proposal of model-free trees: each request's drafted nodes in DFS order."""
    return DraftProposal([list(t.token_ids[1:]) for t in trees], None, [True] * len(trees), trees=trees)


def best_first_tree(root_token: int, root_state: Hashable, expand: Expand, max_depth: int, max_nodes: int,
                    chain: Seq[int] = ()) -> DraftTree:
    """A tree of at most ``max_nodes`` drafted nodes and depth ``<= max_depth``.

    First the nodes of ``chain`` (as far as the budget, the depth and ``expand`` allow: each chain token must
    be one of its parent's candidates), then best-first by rank among the children of kept nodes (ties: the
    order they became candidates in). Siblings are emitted by rank, best first (ties: ``expand``'s order), in
    DFS order.
    """
    tokens, parents, depths, ranks = [root_token], [-1], [0], [()]
    states = [root_state]
    cands: dict[int, list[tuple[int, Rank, Any]]] = {}  # kept node -> its candidate children (lazily)

    def candidates(node: int) -> list[tuple[int, Rank, Any]]:
        if node not in cands:
            cands[node] = expand(states[node]) if depths[node] < max_depth else []  # none at max_depth
        return cands[node]

    def keep(parent: int, token: int, rank: Rank, state: Any) -> int:
        tokens.append(token)
        parents.append(parent)
        depths.append(depths[parent] + 1)
        ranks.append(rank)
        states.append(state)
        return len(tokens) - 1

    taken: set[tuple[int, int]] = set()  # (parent node, token) already kept
    node = 0
    for token in chain:
        if len(tokens) > max_nodes:
            break
        hit = next((c for c in candidates(node) if c[0] == token), None)
        if hit is None:
            break
        taken.add((node, token))
        node = keep(node, *hit)

    heap: list[tuple[Rank, int, int, int, Any]] = []  # (rank, order, parent, token, state)
    order = 0

    def push_children(parent: int) -> None:
        nonlocal order
        room = max_nodes + 1 - len(tokens)  # no more of one node's children can still be kept
        for token, rank, state in candidates(parent):
            if room <= 0:
                break
            if (parent, token) not in taken:
                heapq.heappush(heap, (rank, order, parent, token, state))
                order += 1
                room -= 1

    for kept in range(len(tokens)):
        push_children(kept)
    while heap and len(tokens) <= max_nodes:
        rank, _, parent, token, state = heapq.heappop(heap)
        taken.add((parent, token))
        push_children(keep(parent, token, rank, state))

    return _dfs(tokens, parents, ranks)


def support_trie(root_token: int, continuations: Seq[tuple[Seq[int], int, float]], max_depth: int, max_nodes: int,
                 chain: Seq[int] = ()) -> DraftTree:
    """The token trie of match continuations under a node budget (prompt lookup's and suffix drafting's trees).

    ``continuations``: ``(tokens, count, tie)`` per distinct continuation - ``count`` matches follow it, ``tie``
    orders equally supported siblings (lower first). A node's support is the count of the continuations through it
    and its tie the lowest of theirs; ``best_first_tree`` keeps ``chain`` first, then the best-supported nodes.
    """
    children: list[dict[int, int]] = [{}]
    support: list[int] = [0]
    ties: list[float] = [0.0]
    for tokens, count, tie in continuations:
        node = 0
        for token in tokens[:max_depth]:
            child = children[node].get(token)
            if child is None:
                child = children[node][token] = len(support)
                children.append({})
                support.append(0)
                ties.append(tie)
            support[child] += count
            ties[child] = min(ties[child], tie)
            node = child

    def expand(node: int) -> list[tuple[int, tuple, int]]:
        kids = [(tok, (-support[c], ties[c]), c) for tok, c in children[node].items()]
        kids.sort(key=lambda kid: kid[1])
        return kids

    return best_first_tree(root_token, 0, expand, max_depth, max_nodes, chain)


def _dfs(tokens: list[int], parents: list[int], ranks: list[Rank]) -> DraftTree:
    """Renumber kept nodes (parents before children) into DFS order, siblings by rank (stable)."""
    kids: list[list[int]] = [[] for _ in tokens]
    for i in range(1, len(tokens)):
        kids[parents[i]].append(i)
    new_tokens, new_parents = [], []
    stack = [(0, -1)]
    while stack:
        node, parent = stack.pop()
        new_tokens.append(tokens[node])
        new_parents.append(parent)
        me = len(new_tokens) - 1
        ordered = sorted(kids[node], key=ranks.__getitem__)  # stable: ties keep insertion order
        stack.extend((c, me) for c in reversed(ordered))
    return DraftTree(tuple(new_tokens), tuple(new_parents))
