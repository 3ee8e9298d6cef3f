"""A draft token tree: several candidates per position, verified in one target forward with a tree mask.

Node 0 is the **root**: the request's last committed token (its K/V is written by this step's forward, like
the first token of a chain's verification window). Nodes ``1..n`` are drafts in **DFS order**: a node's parent
comes before it, each node's subtree is contiguous, and siblings appear in the order they were drawn (which is
the order verification tries them). A chain of k drafts is the tree whose parents are ``[-1, 0, 1, ..., k-1]``.

The verification window of a tree is its nodes in this order: window row ``i`` is node ``i``; the target's row
``i`` is p(. | context, path to node i), i.e. the distribution of node i's children (the bonus/correction
distribution at a leaf). Node i sits at KV position ``ctx + i`` (ctx = tokens already in the cache) and at
RoPE position ``ctx + depth[i]``; it attends the context and its ancestors (``tree_mask``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass(frozen=True)
class DraftTree:
    """One request's tree. ``token_ids[0]`` is the root token (the last committed token), ``parents[0] = -1``."""

    token_ids: tuple[int, ...]  # [n + 1] node tokens in DFS order
    parents: tuple[int, ...]  # [n + 1] parent node of each node; parents[0] = -1, parents[i] < i
    depths: tuple[int, ...] = field(init=False)  # [n + 1] depth[0] = 0, depth[i] = depth[parents[i]] + 1

    def __post_init__(self) -> None:
        check_tree(self.token_ids, self.parents)
        depths = [0] * len(self.parents)
        for i in range(1, len(self.parents)):
            depths[i] = depths[self.parents[i]] + 1
        object.__setattr__(self, "depths", tuple(depths))

    @classmethod
    def chain(cls, root: int, drafts: list[int]) -> DraftTree:
        """The tree of a chain: root -> drafts[0] -> drafts[1] -> ..."""
        return cls((root, *drafts), (-1, *range(len(drafts))))

    @property
    def num_drafts(self) -> int:
        """Drafted nodes (the root is not a draft)."""
        return len(self.token_ids) - 1

    @property
    def max_depth(self) -> int:
        return max(self.depths)

    def is_chain(self) -> bool:
        return all(p == i - 1 for i, p in enumerate(self.parents))

    def children(self) -> list[list[int]]:
        """``children()[i]``: node i's children in sibling (verification) order."""
        kids: list[list[int]] = [[] for _ in self.parents]
        for i in range(1, len(self.parents)):
            kids[self.parents[i]].append(i)
        return kids

    def path(self, node: int) -> list[int]:
        """Nodes from the root's first child down to ``node`` (excluding the root; [] for the root)."""
        nodes = []
        while node > 0:
            nodes.append(node)
            node = self.parents[node]
        return nodes[::-1]

    def path_tokens(self, node: int) -> list[int]:
        """The draft tokens on the path to ``node`` (what follows the context if every node on it is accepted)."""
        return [self.token_ids[i] for i in self.path(node)]

    def leaves(self) -> list[int]:
        kids = self.children()
        return [i for i in range(len(self.parents)) if not kids[i]]

    def mask(self) -> torch.Tensor:
        """bool ``[n + 1, n + 1]``: ``mask[i, j]`` iff node j is node i or one of its ancestors."""
        return ancestor_mask(self.parents)


def check_tree(token_ids, parents) -> None:
    """ValueError unless ``parents`` describes a rooted tree in DFS order over ``token_ids``."""
    n = len(parents)
    if n == 0 or len(token_ids) != n:
        raise ValueError(f"a tree needs a root and one parent per token; got {len(token_ids)} tokens, "
                         f"{n} parents")
    if parents[0] != -1:
        raise ValueError(f"node 0 is the root and must have parent -1, got {parents[0]}")
    depths = [0] * n
    for i in range(1, n):
        p = parents[i]
        if not 0 <= p < i:
            raise ValueError(f"parents[{i}] = {p}: a node's parent must be an earlier node (0 <= parent < {i})")
        depths[i] = depths[p] + 1
        # DFS order: i's parent is node i - 1 or one of its ancestors (else p's subtree is not contiguous)
        a = i - 1
        while a != -1 and a != p:
            a = parents[a]
        if a != p:
            raise ValueError(f"nodes are not in DFS order: node {i}'s parent {p} is not on the path to node {i - 1}")
    siblings: dict[tuple[int, int], int] = {}
    for i in range(1, n):
        key = (parents[i], int(token_ids[i]))
        if key in siblings:
            raise ValueError(f"nodes {siblings[key]} and {i} are siblings with the same token {token_ids[i]}")
        siblings[key] = i


def ancestor_mask(parents) -> torch.Tensor:
    """bool ``[n, n]``: ``mask[i, j]`` iff j == i or j is an ancestor of i (``parents`` in DFS order)."""
    n = len(parents)
    mask = torch.zeros(n, n, dtype=torch.bool)
    for i in range(n):
        mask[i, i] = True
        if i:
            mask[i, :i] |= mask[parents[i], :i]
    return mask
