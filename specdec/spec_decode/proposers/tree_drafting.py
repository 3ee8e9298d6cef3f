"""Token trees from a draft model: expand the most promising nodes depth by depth, with tree attention over
the draft's own cache.

One draft forward per depth, batched over every request. Level 0 is the usual catch-up forward (whatever the
draft cache lacks, ending with the root = the request's last token); it gives q at the root. At depth d the
policy decides, from what is already known (the frontier nodes' path scores and their q), how many children
each frontier node gets; the children are then drawn:

- sampled requests: **without replacement** from q at their parent, as the top-c of ``q / E`` with E ~ Exp(1)
  from Philox(seed, position, STREAM_DRAFT) (Gumbel-top-c: the first child is distributed as q - as the chain's
  draft is, though not the same draw: a chain draws by inverse CDF - and the k-th as q with the earlier siblings
  removed and renormalised, what tree verification needs);
- greedy requests: the top-c tokens of q (deterministic: verified as one-hot children).

The number of children of a node is decided before any of them is drawn, and never from their values, which is
what keeps stochastic tree verification lossless (docs/architecture.md, "Token trees"). The new nodes are then
fed to the draft (except at the last depth), each attending the context and its ancestors: the draft cache
holds the tree's nodes level by level after the root, and the tree mask spans those ``w`` positions.

After verification the commit moves the accepted path's K/V in the draft pool too, as in the target's
(``Proposer.move_accepted_path``): the drafter records where each fed node sits
(``DraftModelProposer.tree_positions``), the path's fed prefix moves to ``ctx + 1 ..`` and the draft's valid length
grows by it; only the path's last node (never fed when it is a
leaf at the depth cap) and the bonus token are left to the next catch-up forward.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from specdec.device import to_device
from specdec.kernels.philox import STREAM_DRAFT, row_exponentials
from specdec.runner.model_runner import ForwardItem
from specdec.sampling.penalties import penalty_rows
from specdec.sampling.probs import SamplingTensors, apply_penalty_rows, to_probs_unchecked
from specdec.spec_decode.proposers.base import DraftProposal
from specdec.spec_decode.proposers.draft_vocab import q_over_target
from specdec.spec_decode.proposers.model_drafter import ModelDrafter
from specdec.spec_decode.request import RequestView
from specdec.spec_decode.tree import DraftTree


@dataclass
class TreeShape:
    """How to grow a tree. ``branching``: children per node at each depth (static), or None: dynamic, at most
    ``max_branch`` children per node, best-first under the node budget."""

    branching: list[int] | None
    max_branch: int


@dataclass
class _Growing:
    """One request's tree while it grows (nodes in creation order = BFS; node 0 is the root)."""

    seq: RequestView
    depth_cap: int
    budget: int  # drafted nodes still allowed
    tokens: list[int]
    parents: list[int]
    depths: list[int]
    scores: list[float]  # path probability under q (the dynamic policy's priority)
    q_rows: dict[int, torch.Tensor] = field(default_factory=dict)  # node -> q at it (fp32 [W], the logits' width)
    top_probs: dict[int, list[float]] = field(default_factory=dict)  # node -> its q's largest probabilities
    fed: list[int] = field(default_factory=list)  # nodes in the draft cache after the root, in cache order

    def path_tokens(self, node: int) -> list[int]:
        out = []
        while node > 0:
            out.append(self.tokens[node])
            node = self.parents[node]
        return out[::-1]


def propose_tree(drafter: ModelDrafter, seqs: list[RequestView], depth_caps: list[int], budgets: list[int],
                 shape: TreeShape) -> DraftProposal:
    """A tree per request: depth <= ``depth_caps[i]``, at most ``budgets[i]`` drafted nodes.

    ``drafter``: a model drafter (:class:`~specdec.spec_decode.proposers.model_drafter.ModelDrafter`; its tree
    forwards, root position, vocabulary mapping and ``tree_positions`` are read). Returns trees in DFS order with
    q rows per node (``DraftProposal.trees``).
    """
    grows = [_Growing(s, d, b, [s.last_token_id], [-1], [0], [1.0]) for s, d, b in zip(seqs, depth_caps, budgets)]
    active = [g for g in grows if g.depth_cap > 0 and g.budget > 0]
    frontier = {id(g): [0] for g in active}
    rows: dict[tuple[int, int], int] = {}  # (request, node) -> its row in the last draft forward
    if active:  # level 0: catch-up + the root's q
        logits = drafter.tree_root_forward([g.seq for g in active])  # (len(active), V_draft)
        rows = {(id(g), 0): r for r, g in enumerate(active)}
        _store_q(drafter, logits, [(g, 0) for g in active], shape)
    depth = 0
    while active:
        depth += 1
        new_nodes = _expand_level(drafter, active, frontier, depth, shape)
        active = [g for g in active if new_nodes[id(g)]]
        frontier = new_nodes
        feed = [g for g in active if depth < g.depth_cap and g.budget > 0]
        if feed:
            fed = [(g, n) for g in feed for n in new_nodes[id(g)]]
            parents = [rows[(id(g), g.parents[n])] for g, n in fed]
            logits = drafter.tree_level_forward([_level_item(drafter, g, new_nodes[id(g)]) for g in feed], parents)
            rows = {(id(g), n): r for r, (g, n) in enumerate(fed)}
            _store_q(drafter, logits, fed, shape)
        active = feed
    return _proposal(drafter, seqs, grows)


def _expand_level(drafter: ModelDrafter, active: list[_Growing], frontier: dict[int, list[int]], depth: int,
                  shape: TreeShape) -> dict[int, list[int]]:
    """Decide each frontier node's number of children (before drawing any), then draw them for every request
    at once (one host read); the new nodes per request (their tokens target ids: a reduced draft vocabulary's
    columns mapped back, ``drafter.draft_vocab``)."""
    rows: list[tuple[_Growing, int, int]] = []  # (request, node, children asked)
    for g in active:
        for node, count in zip(frontier[id(g)], _child_counts(g, frontier[id(g)], depth, shape)):
            if count:
                rows.append((g, node, count))
    new: dict[int, list[int]] = {id(g): [] for g in active}
    if not rows:
        return new
    q = torch.stack([g.q_rows[node] for g, node, _ in rows])  # (F, W)
    greedy = [g.seq.params.is_greedy for g, _, _ in rows]
    keys = q  # greedy rows: the top-c tokens of q
    if not all(greedy):
        seeds = to_device([g.seq.seed for g, _, _ in rows], torch.int64, q.device)
        positions = to_device([g.seq.num_tokens + depth - 1 for g, _, _ in rows], torch.int64, q.device)
        noise = row_exponentials(seeds, positions, STREAM_DRAFT, q.shape[-1])  # (F, W), on q's device
        # sampled rows: the top-c of q / E, c draws without replacement from q
        keys = torch.where(to_device(greedy, torch.bool, q.device)[:, None], q, q / noise)
    width = max(c for _, _, c in rows)
    values, ids = torch.topk(keys, width, dim=-1)  # (F, width)
    picked = q.gather(1, ids)  # (F, width) q of each child
    if drafter.draft_vocab is not None:  # columns of a reduced draft vocabulary -> target ids
        ids = drafter.draft_vocab.to_target(ids)
    flat = torch.cat([values.flatten(), ids.flatten().to(q.dtype), picked.flatten()]).tolist()
    n = values.numel()
    for r, (g, node, count) in enumerate(rows):
        for j in range(count):
            value, token, prob = flat[r * width + j], int(flat[n + r * width + j]), flat[2 * n + r * width + j]
            if value <= 0.0:  # q has fewer tokens than children asked for: drawing without replacement stops
                break
            g.tokens.append(token)
            g.parents.append(node)
            g.depths.append(depth)
            g.scores.append(g.scores[node] * prob)
            new[id(g)].append(len(g.tokens) - 1)
    for g in active:
        g.budget -= len(new[id(g)])
    return new


def _child_counts(g: _Growing, frontier: list[int], depth: int, shape: TreeShape) -> list[int]:
    """Children per frontier node at ``depth`` from what is known before drawing: the static shape, or the
    best (path score x the node's j-th largest q) candidates under this level's share of the budget."""
    if shape.branching is not None:
        counts, left = [], g.budget
        for _ in frontier:
            c = min(shape.branching[depth - 1] if depth - 1 < len(shape.branching) else 0, left)
            counts.append(c)
            left -= c
        return counts
    levels_left = g.depth_cap - depth + 1
    quota = min(g.budget, max(1, math.ceil(g.budget / levels_left)))
    candidates = [(g.scores[node] * p, i) for i, node in enumerate(frontier)
                  for p in g.top_probs[node][: shape.max_branch] if p > 0]
    candidates.sort(key=lambda c: -c[0])
    counts = [0] * len(frontier)
    for _, i in candidates[:quota]:
        counts[i] += 1
    return counts


def _level_item(drafter: ModelDrafter, g: _Growing, nodes: list[int]) -> ForwardItem:
    """The forward item feeding ``nodes`` (one depth) to the draft, with the mask over the tree's cached nodes."""
    root = drafter.tree_root_position(g.seq)  # a draft model's root (the last token) sits at num_tokens - 1
    start = root + 1 + len(g.fed)
    g.fed.extend(nodes)
    window = g.fed  # the last len(window) keys of the draft's context are these nodes, in this order
    column = {node: j for j, node in enumerate(window)}
    mask = torch.zeros(len(nodes), len(window), dtype=torch.bool)
    for i, node in enumerate(nodes):
        a = node
        while a > 0:
            mask[i, column[a]] = True
            a = g.parents[a]
    positions = [root + g.depths[n] for n in nodes]
    return ForwardItem(g.seq.seq_id, drafter.in_vocab([g.tokens[n] for n in nodes]), start, len(nodes),
                       positions=positions, mask=mask)


def _store_q(drafter: ModelDrafter, logits: torch.Tensor, rows: list[tuple[_Growing, int]], shape: TreeShape) -> None:
    """Standardize the draft logits of ``rows`` (same transform and penalty context as the target's p) and keep
    q and its largest probabilities per node. NaN/inf rows raise (the engine fails their requests)."""
    params = [g.seq.params for g, _ in rows]
    st = SamplingTensors.from_params(params, logits.device)
    if st.any_penalty:  # ids beyond the draft's vocabulary (or outside a reduced one) have no logit to penalise
        contexts = [g.seq.penalty_counts(g.path_tokens(n)) if g.seq.params.has_penalties else None for g, n in rows]
        if drafter.draft_vocab is not None:  # target ids -> the reduced vocabulary's columns
            contexts = [drafter.draft_vocab.context(c) for c in contexts]
        logits = apply_penalty_rows(logits, penalty_rows(contexts, logits.shape[-1], logits.device), st)
    probs, bad = to_probs_unchecked(logits, st)  # greedy rows: q at temperature 1 (its order is the argmax's)
    # the dynamic policy ranks candidates by q's largest probabilities; a static shape needs none
    width = min(8, probs.shape[-1]) if shape.branching is None else 0
    top = torch.topk(probs, width, dim=-1).values  # (R, width)
    flat = torch.cat([top.flatten(), bad.to(top.dtype)]).tolist()  # one host read
    bad_rows = [r for r in range(len(rows)) if flat[len(rows) * width + r]]
    if bad_rows:
        names = sorted({rows[r][0].seq.request_id for r in bad_rows})
        raise FloatingPointError(f"non-finite draft logits (NaN or inf) for requests {names}; "
                                 "refusing to sample from them")
    for r, (g, node) in enumerate(rows):
        g.q_rows[node] = probs[r]
        g.top_probs[node] = flat[r * width : (r + 1) * width]


def _proposal(drafter: ModelDrafter, seqs: list[RequestView], grows: list[_Growing]) -> DraftProposal:
    """Re-number every tree in DFS order and lay out q per node (rows of the target vocabulary: zero-padded, or
    scattered from a reduced draft vocabulary's columns - ``draft_vocab.q_over_target``)."""
    trees, q_lists = [], []
    for g in grows:
        drafter.tree_positions[g.seq.seq_id] = {}
        kids: list[list[int]] = [[] for _ in g.tokens]
        for node in range(1, len(g.tokens)):
            kids[g.parents[node]].append(node)
        order, stack = [], [0]
        while stack:
            node = stack.pop()
            order.append(node)
            stack.extend(reversed(kids[node]))
        new_index = {old: new for new, old in enumerate(order)}
        # draft-cache position of every fed node, by its DFS index (they follow the root)
        root = drafter.tree_root_position(g.seq)
        drafter.tree_positions[g.seq.seq_id] = {new_index[node]: root + 1 + j for j, node in enumerate(g.fed)}
        trees.append(DraftTree(tuple(g.tokens[o] for o in order),
                               tuple(-1 if o == 0 else new_index[g.parents[o]] for o in order)))
        q_lists.append([g.q_rows.get(o) for o in order])
    is_onehot = [s.params.is_greedy for s in seqs]
    probs = None
    if not all(is_onehot):
        vocab = drafter.target_vocab_size
        device = next((q for qs in q_lists for q in qs if q is not None), torch.empty(0)).device
        probs = torch.zeros(sum(len(t.token_ids) for t in trees), vocab, dtype=torch.float32, device=device)
        rows, qs_kept, row = [], [], 0
        for qs, onehot in zip(q_lists, is_onehot):
            for q in qs:
                if q is not None and not onehot:
                    rows.append(row)
                    qs_kept.append(q)
                row += 1
        if rows:  # one scatter for every node with a q: [len(rows), W] -> [len(rows), V]
            probs[to_device(rows, torch.int64, device)] = q_over_target(torch.stack(qs_kept), drafter.draft_vocab,
                                                                        vocab)
    forwards = [max(t.depths) if t.num_drafts else (1 if g.depth_cap > 0 and g.budget > 0 else 0)
                for t, g in zip(trees, grows)]
    return DraftProposal([list(t.token_ids[1:]) for t in trees], probs, is_onehot, forwards, trees)
