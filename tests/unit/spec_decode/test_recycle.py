"""Recycled candidates (method "recycle"): the candidate matrix, its chains and trees against brute force, its
scopes, and the step's hand-over of every logits row's top-W ids."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch
from helpers import small_llm

from specdec import SamplingParams, SpeculativeConfig
from specdec.cli.parser import build_parser, speculative_config
from specdec.spec_decode.proposers.recycle import RANK_PRIOR, CandidateMatrix, RecycleProposer


def matrix(rows: dict[int, list[int]], vocab: int = 20, width: int = 3) -> CandidateMatrix:
    m = CandidateMatrix(vocab, width)
    m.update(np.array(list(rows), dtype=np.int64), np.array(list(rows.values()), dtype=np.int64))
    return m


class Seq:
    def __init__(self, seq_id, last):
        self.seq_id, self.last_token_id = seq_id, last


def test_update_keeps_the_latest_row_and_ignores_ids_outside_the_vocabulary():
    m = CandidateMatrix(10, 2)
    m.update(np.array([3, 5, 3, 42, -1]), np.array([[1, 2], [4, 4], [7, 8], [9, 9], [9, 9]]))
    assert m.rows[3].tolist() == [7, 8] and m.rows[5].tolist() == [4, 4]
    assert (m.rows[[0, 1, 2, 4, 6, 7, 8, 9]] == -1).all()


def test_chain_follows_the_first_candidate_and_stops_without_a_row():
    m = matrix({1: [2, 3, 4], 2: [5, 1, 0], 5: [1, 9, 8]})
    assert m.chain(1, 6) == [2, 5, 1, 2, 5, 1]
    assert m.chain(3, 4) == []  # no row for 3: no drafts
    assert matrix({1: [2, 3, 4]}).chain(1, 4) == [2]


def brute_force_tree(m: CandidateMatrix, root: int, depth: int, width: int) -> dict[tuple[int, ...], float]:
    """Every path of the full W-ary candidate tree (to ``depth``) with its prior probability."""
    paths = {(): 1.0}
    frontier = [((), root, 1.0)]
    for _ in range(depth):
        nxt = []
        for path, token, prob in frontier:
            for j, cand in enumerate(m.rows[token, :width].tolist()):
                if cand < 0:
                    break
                p = prob * RANK_PRIOR[j]
                paths[path + (cand,)] = p
                nxt.append((path + (cand,), cand, p))
        frontier = nxt
    return paths


@pytest.mark.parametrize("seed,depth,budget,width", list(itertools.product(range(6), (1, 3, 5), (1, 4, 12), (1, 3))))
def test_tree_is_the_chain_then_the_most_probable_paths(seed, depth, budget, width):
    gen = np.random.default_rng(seed)
    vocab = 12
    m = CandidateMatrix(vocab, 3)
    for t in range(vocab):
        if gen.random() < 0.85:  # some tokens have no row
            m.rows[t] = gen.choice(vocab, 3, replace=False)
    root = 0
    tree = m.tree(root, depth, budget, width)
    paths = {tuple(tree.path_tokens(i)) for i in range(len(tree.token_ids))}
    everything = brute_force_tree(m, root, depth, width)
    assert tree.token_ids[0] == root and paths <= set(everything)
    assert tree.num_drafts == min(budget, len(everything) - 1)
    assert tree.max_depth <= depth
    chain = m.chain(root, depth)
    kept = chain[: min(len(chain), budget)]
    assert tuple(kept) in paths  # the chain first, as far as the budget holds it
    # past the chain, no left-out path is more probable than a kept non-chain node (ties aside)
    chain_prefixes = {tuple(kept[:i]) for i in range(len(kept) + 1)}
    extra = [everything[p] for p in paths - chain_prefixes]
    left_out = [everything[p] for p in set(everything) - paths if p[:-1] in paths]
    if extra and left_out:
        assert min(extra) >= max(left_out) - 1e-12
    for i in range(1, len(tree.token_ids)):  # siblings are distinct
        sibs = [tree.token_ids[j] for j in range(1, len(tree.token_ids)) if tree.parents[j] == tree.parents[i]]
        assert len(sibs) == len(set(sibs))


def test_no_row_or_no_budget_gives_a_root_only_tree():
    m = matrix({1: [2, 3, 4]})
    assert m.tree(5, 3, 8, 3).num_drafts == 0
    assert m.tree(1, 0, 8, 3).num_drafts == 0 and m.tree(1, 3, 0, 3).num_drafts == 0


def test_scopes():
    shared = RecycleProposer(20, 2, "engine")
    shared.take_candidates([1, 2], [4, 5], [[6, 7], [8, 9]])
    assert shared.propose([Seq(3, 4), Seq(9, 5)], [1, 1]).token_ids == [[6], [8]]  # every request reads one matrix
    own = RecycleProposer(20, 2, "request")
    own.take_candidates([1, 2, 1], [4, 4, 5], [[6, 7], [8, 9], [1, 2]])
    assert own.propose([Seq(1, 4), Seq(2, 4), Seq(3, 4)], [1, 1, 1]).token_ids == [[6], [8], []]
    own.free(1, finished=False)  # preempted: it keeps its matrix
    assert own.propose([Seq(1, 5)], [1]).token_ids == [[1]]
    own.free(1, finished=True)
    assert own.propose([Seq(1, 5)], [1]).token_ids == [[]]
    with pytest.raises(ValueError, match="recycle_scope 'tenant'"):
        RecycleProposer(20, 2, "tenant")


def test_config_and_cli_errors():
    assert SpeculativeConfig(method="recycle").tree == "dynamic"  # it drafts trees
    assert SpeculativeConfig(method="recycle", tree=[2, 1]).tree == [2, 1]
    with pytest.raises(ValueError, match="recycle_scope 'user'"):
        SpeculativeConfig(method="recycle", recycle_scope="user")
    with pytest.raises(ValueError, match="recycle_scope is for methods .recycle. and .pick."):
        SpeculativeConfig(method="prompt_lookup", recycle_scope="request")
    parser = build_parser()
    args = parser.parse_args(["generate", "--prompt", "x", "--speculative-method", "recycle", "--recycle-scope",
                              "request"])
    assert speculative_config(args).recycle_scope == "request"
    with pytest.raises(ValueError, match="--recycle-scope needs --speculative-method recycle or pick"):
        speculative_config(parser.parse_args(["generate", "--prompt", "x", "--recycle-scope", "request"]))


def test_the_step_hands_over_the_top_ids_of_every_logits_row(tiny_pair):
    """Spy the target forward's logits and the proposer's hand-over: each row's input token and its top-W ids,
    prefill chunks, plain decodes and tree windows alike, for every request of the batch."""
    llm = small_llm(tiny_pair[0], dtype="float32", block_size=4, max_model_len=256, max_num_seqs=3,
                    max_num_batched_tokens=24,
                    speculative=SpeculativeConfig(method="recycle", num_speculative_tokens=3, tree_policy="always"))
    engine, proposer = llm.engine, llm.engine.speculative.proposer
    seen, handed = [], []
    real_forward, real_take = engine.runner.forward, proposer.take_candidates

    def forward(items, **kw):
        logits = real_forward(items, **kw)
        seen.append(([(it.seq_id, it.token_ids[len(it.token_ids) - it.num_logits:]) for it in items], logits.clone()))
        return logits

    def take(seq_ids, tokens, candidates):
        handed.append((seq_ids, tokens, candidates))
        real_take(seq_ids, tokens, candidates)

    engine.runner.forward, proposer.take_candidates = forward, take
    prompts = [[5, 6, 7, 5, 6, 7, 5, 6] * 2, list(range(40, 80)), [9, 9, 9]]
    outs = llm.generate(prompt_token_ids=prompts, sampling_params=SamplingParams(temperature=0, max_tokens=12,
                                                                                 ignore_eos=True))
    assert all(o.outputs[0].finish_reason == "length" for o in outs)
    assert len(seen) == len(handed) and sum(o.metrics["drafted"] for o in outs) > 0
    for (rows, logits), (seq_ids, tokens, candidates) in zip(seen, handed):
        assert seq_ids == [s for s, toks in rows for _ in toks]
        assert tokens == [t for _, toks in rows for t in toks]
        assert candidates == torch.topk(logits, proposer.candidate_width, dim=-1).indices.tolist()
