"""Model-free token trees (prompt lookup, n-gram) against brute-force oracles on random repetitive streams.

Properties: the tree is valid, within depth and budget; every path is a continuation actually seen after a
match (prompt lookup) or a chain of table predictions (n-gram); siblings are ordered by support (by path
probability for n-gram), ties most recent first; the budget keeps the best-ranked nodes after the chain, which
is always a path when the budget holds it; greedy tree verification never accepts fewer tokens than the chain.
"""

import random

import numpy as np
import pytest
import torch

from specdec.engine.sequence import Sequence
from specdec.sampling.params import SamplingParams
from specdec.spec_decode.proposers import prompt_lookup as prompt_lookup_module
from specdec.spec_decode.proposers.base import DraftProposal
from specdec.spec_decode.proposers.combined import CombinedProposer
from specdec.spec_decode.proposers.ngram_table import NgramTable, NgramTableProposer
from specdec.spec_decode.proposers.prompt_lookup import (
    PromptLookupProposer,
    lookup_matches,
    prompt_lookup,
    prompt_lookup_tree,
)
from specdec.spec_decode.tree import DraftTree


def streams(n, seed=0):
    """Random streams over small vocabularies with copied spans: many matches of every length."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        vocab = rng.randint(2, 6)
        tokens = [rng.randrange(vocab) for _ in range(rng.randint(1, 12))]
        while len(tokens) < rng.randint(2, 60):
            if rng.random() < 0.5 and len(tokens) > 3:
                start = rng.randrange(len(tokens) - 2)
                tokens += tokens[start : start + rng.randint(1, 6)]
            else:
                tokens.append(rng.randrange(vocab))
        out.append(tokens)
    return out


def node_paths(tree):
    """{path tokens (tuple): node} for every drafted node."""
    return {tuple(tree.path_tokens(i)): i for i in range(1, len(tree.token_ids))}


def greedy_accepted(tree, target):
    """Greedy tree verification against a known target continuation: follow the child equal to the next token."""
    kids, node, n = tree.children(), 0, 0
    while n < len(target):
        nxt = next((c for c in kids[node] if tree.token_ids[c] == target[n]), None)
        if nxt is None:
            break
        node, n = nxt, n + 1
    return n


# --- prompt lookup: brute-force oracle ----------------------------------------------------------------------
def oracle_matches(tokens, min_ngram, max_ngram):
    """[(continuation start, match length)] of every earlier match, longest first then most recent."""
    length = len(tokens)
    found = []
    for p in range(1, length):  # continuation starts; p = length would be the suffix itself
        n = 0
        while n < max_ngram and n < p and tokens[p - 1 - n] == tokens[length - 1 - n]:
            n += 1
        if n >= min_ngram:
            found.append((p, n))
    return sorted(found, key=lambda m: (-m[1], -m[0]))


def oracle_keys(tokens, depth, min_ngram, max_ngram, max_matches=None):
    """{path: (support, most recent start)} of the trie of the best ``max_matches`` continuations."""
    keys = {}
    for p, _ in oracle_matches(tokens, min_ngram, max_ngram)[:max_matches]:
        cont = tokens[p : p + depth]
        for i in range(1, len(cont) + 1):
            support, recent = keys.get(tuple(cont[:i]), (0, -1))
            keys[tuple(cont[:i])] = (support + 1, max(recent, p))
    return keys


LOOKUP_CASES = [(t, d, b, lo, hi) for t, (d, b, lo, hi) in zip(
    streams(120), [(d, b, lo, hi) for d in (1, 3, 5) for b in (1, 4, 8, 40) for lo, hi in ((1, 3), (2, 4))] * 5)]


@pytest.mark.parametrize("keep_chain", [True, False])
@pytest.mark.parametrize("tokens,depth,budget,lo,hi", LOOKUP_CASES)
def test_prompt_lookup_tree_against_the_oracle(tokens, depth, budget, lo, hi, keep_chain):
    tree = prompt_lookup_tree(tokens, depth, budget, lo, hi, keep_chain=keep_chain)
    assert tree.token_ids[0] == tokens[-1] and tree.num_drafts <= budget and tree.max_depth <= depth
    keys = oracle_keys(tokens, depth, lo, hi)
    paths = node_paths(tree)
    assert set(paths) <= set(keys)  # every path is (a prefix of) a continuation seen after a match
    # siblings: best support first, ties most recent first
    for kids in tree.children():
        ranked = [keys[tuple(tree.path_tokens(c))] for c in kids]
        assert ranked == sorted(ranked, reverse=True)
    # the chain is a path whenever the budget holds it; the rest are the best-ranked candidates
    chain = prompt_lookup(tokens, depth, lo, hi) if keep_chain else []
    if len(chain) <= budget:
        assert tuple(chain) in paths or not chain
    else:
        assert list(paths) == [tuple(chain[:i]) for i in range(1, budget + 1)]
    on_chain = {tuple(chain[:i]) for i in range(1, len(chain) + 1)}
    kept = [keys[p] for p in paths if p not in on_chain]
    frontier = [keys[p] for p in keys if p not in paths and (len(p) == 1 or p[:-1] in paths)]
    if kept and frontier:
        assert min(kept) >= max(frontier)
    if frontier:  # the budget is what stopped it
        assert tree.num_drafts == budget
    if budget >= len(keys):
        assert set(paths) == set(keys)  # a large enough budget keeps every continuation


def test_prompt_lookup_tree_merges_every_match():
    # suffix "1 2" occurs after 7 (-> 3 9), after 9 (-> 4 8) and after 8 (-> 3 5): 3 has two supporting matches
    tokens = [7, 1, 2, 3, 9, 1, 2, 4, 8, 1, 2, 3, 5, 1, 2]
    tree = prompt_lookup_tree(tokens, 2, 8, 2, 4)
    assert tree.token_ids == (2, 3, 5, 9, 4, 8)
    assert tree.parents == (-1, 0, 1, 1, 0, 4)
    # budget 3: the chain (the latest match: 3 5), then the best remaining node: 9 (under 3) and 4 have one
    # supporting match each; the more recent one (4, matched at 7 against 9's 3) wins
    small = prompt_lookup_tree(tokens, 2, 3, 2, 4)
    assert {tuple(small.path_tokens(i)) for i in range(1, 4)} == {(3,), (3, 5), (4,)}


def test_prompt_lookup_tree_prefers_longer_matches_under_the_match_cap():
    # with room for one match only, the longest one ("5 6 7" -> 8) wins over more recent shorter ones
    tokens = [5, 6, 7, 8, 1, 6, 7, 9, 2, 6, 7, 3, 5, 6, 7]
    assert prompt_lookup_tree(tokens, 1, 4, 1, 3, max_matches=1).token_ids == (7, 8)
    # all matches: one supporting match each, so the most recent first (the chain's 8 is kept, tried last)
    assert prompt_lookup_tree(tokens, 1, 4, 1, 3).token_ids == (7, 3, 9, 8)


def test_prompt_lookup_tree_keeps_the_best_supported_branch_not_the_most_recent():
    # after 0: 1 three times, 2 twice, then 3 (the latest match: the chain). Room for one more: 1, tried first
    tokens = [0, 1, 0, 1, 0, 1, 0, 2, 0, 2, 0, 3, 0]
    assert prompt_lookup_tree(tokens, 1, 2, 1, 1).token_ids == (0, 1, 3)
    assert prompt_lookup_tree(tokens, 1, 3, 1, 1).token_ids == (0, 1, 2, 3)


def test_match_cap_bounds_the_tree():
    tokens = [1, 2] * 40 + [1]
    # the latest match ends two tokens before the end: its continuation is cut short (what the chain drafts);
    # the one before it runs the full depth. All matches agree, so the trie is one path.
    assert prompt_lookup_tree(tokens, 4, 50, 1, 3, max_matches=1).token_ids[1:] == (2, 1)
    for cap in (2, 5, 64):
        tree = prompt_lookup_tree(tokens, 4, 50, 1, 3, max_matches=cap)
        assert tree.is_chain() and tree.token_ids[1:] == (2, 1, 2, 1)


@pytest.mark.parametrize("seed", range(3))
def test_lookup_matches_vectorised_and_python_agree(seed):
    # binary streams of 300 tokens: ~150 candidates, over the Python path's limit of 64
    rng = random.Random(seed)
    tokens = [rng.randrange(2) for _ in range(300)]
    arr = np.asarray(tokens, dtype=np.int64)
    starts = np.flatnonzero(arr[:-1] == arr[-1]) + 1
    assert starts.size > prompt_lookup_module._PY_EXTEND_MAX
    py = prompt_lookup_module._match_lengths_py(tokens, starts.tolist(), 6)
    assert prompt_lookup_module._match_lengths_np(arr, starts, 6).tolist() == py
    got_starts, got_lengths = lookup_matches(arr, 2, 6)
    assert list(zip(got_starts.tolist(), got_lengths.tolist())) == oracle_matches(tokens, 2, 6)


def test_drafter_keeps_its_array_in_step_with_the_request():
    drafter = PromptLookupProposer(1, 3)
    text = streams(1, seed=5)[0] * 3
    s = seq(text[:5])
    for n in range(5, len(text)):
        if n > 5:
            s.append_token(text[n - 1])
        assert drafter.propose([s], [3]).token_ids[0] == prompt_lookup(text[:n], 3, 1, 3)
        tree = drafter.propose_tree([s], [3], [6]).trees[0]
        assert tree == prompt_lookup_tree(text[:n], 3, 6, 1, 3)
    # the same seq id, another (longer) request: its own text, not the old one's prefix
    other = seq(list(range(100, 100 + len(text))) + [100], seq_id=0)
    assert drafter.propose([other], [2]).token_ids[0] == [101, 102]
    drafter.free(other.seq_id, finished=True)  # nothing to drop: the text lives in the sequence's own history
    assert drafter.propose([s], [3]).token_ids[0] == prompt_lookup(s.all_token_ids, 3, 1, 3)


@pytest.mark.parametrize("depth,budget", [(0, 5), (4, 0), (0, 0)])
def test_no_budget_or_no_match_gives_a_root_only_tree(depth, budget):
    assert prompt_lookup_tree([1, 2, 1, 2], depth, budget, 1, 2) == DraftTree((2,), (-1,))
    assert prompt_lookup_tree([1, 2, 3], 4, 8, 1, 2) == DraftTree((3,), (-1,))  # no earlier match
    table = NgramTable()
    for t in [1, 2, 1, 2]:
        table.push(t)
    assert table.predict_tree(depth, budget) == DraftTree((2,), (-1,))


# --- n-gram: oracle over the window -------------------------------------------------------------------------
def oracle_continuations(window, context, min_order, max_order):
    """{token: (count, last index)} after the longest context (order max..min) seen in ``window``."""
    for n in range(max_order, min_order - 1, -1):
        if len(context) < n - 1:
            continue
        ctx = list(context[len(context) - (n - 1):])
        found = {}
        for i in range(len(window) - n + 1):
            if window[i : i + n - 1] == ctx:
                count, _ = found.get(window[i + n - 1], (0, -1))
                found[window[i + n - 1]] = (count + 1, i)
        if found:
            return found
    return {}


def oracle_probs(window, tree, min_order, max_order):
    """{node: path probability} (None if a node's token is not a table prediction of its path)."""
    probs = {0: 1.0}
    for i in range(1, len(tree.token_ids)):
        context = window + tree.path_tokens(tree.parents[i])
        conts = oracle_continuations(window, context, min_order, max_order)
        if tree.token_ids[i] not in conts:
            return None
        total = sum(c for c, _ in conts.values())
        probs[i] = probs[tree.parents[i]] * conts[tree.token_ids[i]][0] / total
    return probs


NGRAM_CASES = [(t, d, b) for t, (d, b) in zip(streams(60, seed=1), [(d, b) for d in (1, 3, 5) for b in (1, 4, 12)] * 7)]


@pytest.mark.parametrize("keep_chain", [True, False])
@pytest.mark.parametrize("tokens,depth,budget", NGRAM_CASES)
def test_ngram_tree_against_the_oracle(tokens, depth, budget, keep_chain):
    window_size = 24
    table = NgramTable(2, 4, window_size)
    for t in tokens:
        table.push(t)
    window = tokens[-window_size:]
    tree = table.predict_tree(depth, budget, keep_chain)
    assert tree.token_ids[0] == tokens[-1] and tree.num_drafts <= budget and tree.max_depth <= depth
    probs = oracle_probs(window, tree, 2, 4)
    assert probs is not None  # every path is a chain of table predictions
    kids = tree.children()
    for i, siblings in enumerate(kids):
        conts = oracle_continuations(window, window + tree.path_tokens(i), 2, 4)
        ranked = [conts[tree.token_ids[c]] for c in siblings]
        assert ranked == sorted(ranked, reverse=True)  # most frequent first, ties most recently seen
        # best-first: no dropped child of a kept node (outside the chain) beats a kept non-chain node
    chain = table.predict(depth) if keep_chain else []
    paths = node_paths(tree)
    if len(chain) <= budget:
        assert tuple(chain) in paths or not chain
    on_chain = {paths[tuple(chain[:i])] for i in range(1, len(chain) + 1) if tuple(chain[:i]) in paths}
    kept = [probs[i] for i in range(1, len(tree.token_ids)) if i not in on_chain]
    dropped = []
    for i in range(len(tree.token_ids)):
        if tree.depths[i] >= depth:
            continue
        conts = oracle_continuations(window, window + tree.path_tokens(i), 2, 4)
        total = sum(c for c, _ in conts.values())
        present = {tree.token_ids[c] for c in kids[i]}
        dropped += [probs[i] * c / total for tok, (c, _) in conts.items() if tok not in present]
    if kept and dropped:
        assert min(kept) >= max(dropped) - 1e-12
    if dropped:
        assert tree.num_drafts == budget


def test_ngram_tree_branches_on_the_runner_up():
    # after (1, 2): 3 twice, 4 once -> the tree holds the chain via 3 and a branch via 4
    table = NgramTable(2, 3)
    for t in [1, 2, 3, 0, 1, 2, 4, 0, 1, 2, 3, 0, 1, 2]:
        table.push(t)
    tree = table.predict_tree(2, 3)
    assert table.predict(2) == [3, 0]
    assert tree.token_ids == (2, 3, 0, 4) and tree.parents == (-1, 0, 1, 0)


def test_ngram_tree_keeps_the_most_frequent_runner_up_not_the_most_recent():
    # after 0: 1 three times, 2 twice, 3 once (the most recent); room for one branch beside the chain -> 2
    table = NgramTable(2, 2)
    for t in [0, 1, 0, 1, 0, 1, 0, 2, 0, 2, 0, 3, 0]:
        table.push(t)
    assert table.predict_tree(1, 2).token_ids == (0, 1, 2)
    assert table.predict_tree(1, 3).token_ids == (0, 1, 2, 3)


def test_without_keep_chain_the_budget_goes_to_the_most_probable_nodes():
    # after 0: 1 twice, 2 twice (most recent: the chain's); after 2: 6 once, 7 once (most recent). The chain
    # 2 7 has probability 1/4 at 7; without keep_chain the second node is the runner-up 1 (probability 1/2)
    stream = [0, 1, 5, 0, 1, 5, 0, 2, 6, 0, 2, 7, 0]
    table = NgramTable(2, 2)
    for t in stream:
        table.push(t)
    assert table.predict(2) == [2, 7]
    assert table.predict_tree(2, 2).token_ids == (0, 2, 7)
    assert table.predict_tree(2, 2, keep_chain=False).token_ids == (0, 2, 1)
    tree = NgramTableProposer(2, 2, keep_chain=False).propose_tree([seq(stream)], [2], [2]).trees[0]
    assert tree.token_ids == (0, 2, 1)
    # prompt lookup: after 0 come 1 5, 1 5, 2 6, 2 7 (the latest match: the chain 2 7)
    assert prompt_lookup_tree(stream, 2, 2, 1, 1).token_ids == (0, 2, 7)
    assert prompt_lookup_tree(stream, 2, 2, 1, 1, keep_chain=False).token_ids == (0, 2, 1)
    drafter = PromptLookupProposer(1, 1, keep_chain=False)
    assert drafter.propose_tree([seq(stream)], [2], [2]).trees[0].token_ids == (0, 2, 1)


# --- both drafters: proposal shape, greedy acceptance, determinism, bad input -----------------------------
def seq(tokens, seq_id=0):
    return Sequence(seq_id, f"r{seq_id}", None, list(tokens), SamplingParams(), 0, frozenset())


@pytest.mark.parametrize("make", [PromptLookupProposer, NgramTableProposer])
def test_propose_tree_proposal(make):
    drafter = make()
    seqs = [seq(t, i) for i, t in enumerate(streams(6, seed=3))]
    depths, budgets = [4, 0, 3, 5, 2, 4], [8, 4, 0, 16, 1, 8]
    proposal = drafter.propose_tree(seqs, depths, budgets)
    assert isinstance(proposal, DraftProposal) and proposal.probs is None and proposal.is_onehot == [True] * 6
    for s, d, b, tree, drafts in zip(seqs, depths, budgets, proposal.trees, proposal.token_ids):
        assert tree.token_ids[0] == s.last_token_id and drafts == list(tree.token_ids[1:])
        assert tree.num_drafts <= b and tree.max_depth <= d
    assert proposal.trees[1].num_drafts == proposal.trees[2].num_drafts == 0
    again = make().propose_tree(seqs, depths, budgets)
    assert again.trees == proposal.trees and again.token_ids == proposal.token_ids  # deterministic


@pytest.mark.parametrize("make", [PromptLookupProposer, NgramTableProposer])
def test_tree_accepts_at_least_the_chain(make):
    """Greedy tree verification against the stream's true continuation never accepts fewer than the chain."""
    gained = 0
    for i, tokens in enumerate(streams(80, seed=4)):
        cut = len(tokens) * 2 // 3
        if cut < 2:
            continue
        s, target = seq(tokens[:cut], i), tokens[cut:]
        chain = make().propose([s], [4]).token_ids[0]
        tree = make().propose_tree([s], [4], [12]).trees[0]
        chain_acc = greedy_accepted(DraftTree.chain(s.last_token_id, chain), target)
        tree_acc = greedy_accepted(tree, target)
        assert tree_acc >= chain_acc
        gained += tree_acc > chain_acc
    assert gained > 0  # the extra candidates do get accepted sometimes


@pytest.mark.parametrize("make", [PromptLookupProposer, NgramTableProposer])
@pytest.mark.parametrize("depths,budgets,match", [
    ([4], [4, 4], "one max_depth and one max_nodes per request"),
    ([4, 4], [4], "one max_depth and one max_nodes per request"),
    ([-1, 4], [4, 4], "max_depths must be non-negative"),
    ([4, 4], [4, -2], "max_nodes must be non-negative"),
])
def test_bad_budgets_are_rejected(make, depths, budgets, match):
    with pytest.raises(ValueError, match=match):
        make().propose_tree([seq([1, 2, 1, 2]), seq([3, 3, 3], 1)], depths, budgets)


@pytest.mark.parametrize("make", [PromptLookupProposer, NgramTableProposer])
def test_numpy_budgets_are_accepted_and_bools_are_not(make):
    seqs = [seq([1, 2, 1, 2])]
    assert make().propose_tree(seqs, [np.int64(2)], [np.int32(2)]).trees[0].num_drafts == 2
    with pytest.raises(ValueError, match="max_nodes must be non-negative integers"):
        make().propose_tree(seqs, [2], [True])


def test_prompt_lookup_needs_a_match_to_merge():
    with pytest.raises(ValueError, match="max_matches"):
        PromptLookupProposer(max_matches=0)


# --- combined: the lookup's tree, the draft model's chain (as a tree, with q rows per node) for misses ------
class FakeDraftModel:
    """Chains of 7s with q rows numbered by draft position (not one-hot); its trees are those chains (as a draft
    model without a tree shape drafts them: node j's q row is the row its child was drawn from, the leaf's zeros)."""

    max_positions = None
    block_managers = []

    def propose(self, seqs, num_tokens):
        drafts = [[7] * k for k in num_tokens]
        rows = [torch.full((1, 3), float(j + 1)) for d in drafts for j in range(len(d))]
        return DraftProposal(drafts, torch.cat(rows), [False] * len(seqs), [len(d) for d in drafts])

    def propose_tree(self, seqs, max_depths, max_nodes):
        chains = self.propose(seqs, [min(d, n) for d, n in zip(max_depths, max_nodes)])
        trees = [DraftTree.chain(s.last_token_id, d) for s, d in zip(seqs, chains.token_ids)]
        rows, start = [], 0
        for d in chains.token_ids:
            rows += [chains.probs[start : start + len(d)], torch.zeros(1, 3)]
            start += len(d)
        return DraftProposal(chains.token_ids, torch.cat(rows), chains.is_onehot, chains.draft_forwards, trees)


def test_combined_forwards_trees_and_takes_the_draft_models_for_misses():
    hit, miss = seq([1, 2, 3, 1, 2, 4, 1, 2], 0), seq([5, 6], 1)
    drafter = CombinedProposer(PromptLookupProposer(), FakeDraftModel())
    proposal = drafter.propose_tree([hit, miss], [2, 3], [4, 2])
    lookup = PromptLookupProposer().propose_tree([hit], [2], [4]).trees[0]
    assert proposal.trees[0] == lookup and proposal.trees[1] == DraftTree.chain(6, [7, 7])
    assert proposal.is_onehot == [True, False] and proposal.draft_forwards == [0, 2]
    assert proposal.token_ids == [list(lookup.token_ids[1:]), [7, 7]]
    # q rows: n_b + 1 per request; the miss's node j carries the row its child was drawn from, its leaf zeros
    n = lookup.num_drafts + 1
    assert proposal.probs.shape == (n + 3, 3)
    assert proposal.probs[:n].eq(0).all()
    assert proposal.probs[n:, 0].tolist() == [1.0, 2.0, 0.0]


class FakeTreeDraftModel(FakeDraftModel):
    """Also drafts trees: root -> 7 -> 8 and root -> 9, with q row i = i + 1 at node i (leaves too)."""

    def propose_tree(self, seqs, max_depths, max_nodes):
        trees = [DraftTree((s.last_token_id, 7, 8, 9), (-1, 0, 1, 0)) for s in seqs]
        rows = [torch.full((1, 3), float(i + 1)) for _ in seqs for i in range(4)]
        return DraftProposal([[7, 8, 9] for _ in seqs], torch.cat(rows), [False] * len(seqs), [2] * len(seqs), trees)


def test_combined_takes_the_draft_models_trees_for_misses():
    miss, hit, miss2 = seq([5, 6], 0), seq([1, 2, 3, 1, 2], 1), seq([4], 2)
    proposal = CombinedProposer(PromptLookupProposer(), FakeTreeDraftModel()).propose_tree(
        [miss, hit, miss2], [3, 3, 3], [4, 4, 4])
    lookup = PromptLookupProposer().propose_tree([hit], [3], [4]).trees[0]
    assert lookup.num_drafts > 0
    assert proposal.trees[1] == lookup
    assert [t.token_ids for t in (proposal.trees[0], proposal.trees[2])] == [(6, 7, 8, 9), (4, 7, 8, 9)]
    assert proposal.is_onehot == [False, True, False] and proposal.draft_forwards == [2, 0, 2]
    n = lookup.num_drafts + 1
    assert proposal.probs[:, 0].tolist() == [1.0, 2.0, 3.0, 4.0] + [0.0] * n + [1.0, 2.0, 3.0, 4.0]


def test_combined_without_misses_is_the_lookups_proposal():
    hit = seq([1, 2, 3, 1, 2], 0)
    proposal = CombinedProposer(PromptLookupProposer(), FakeTreeDraftModel()).propose_tree([hit], [3], [4])
    assert proposal.trees == PromptLookupProposer().propose_tree([hit], [3], [4]).trees and proposal.probs is None
