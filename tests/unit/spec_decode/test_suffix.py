"""Suffix drafting (method "suffix"): the index's lookups and eviction against brute force, the ranking of matches,
and tenants - one tenant's outputs never change another's drafts unless the index is shared on purpose."""

from __future__ import annotations

import random

import numpy as np
import pytest
from helpers import small_llm

from specdec import SamplingParams, SpeculativeConfig
from specdec.spec_decode.proposers import suffix as suffix_module
from specdec.spec_decode.proposers.suffix import SPEC_FACTOR, SuffixIndex, SuffixProposer, rank_matches, suffix_chain


def brute_matches(docs: list[list[int]], context: list[int]) -> set[tuple[int, int, tuple[int, ...]]]:
    """(length, doc, continuation) of every position of every doc whose preceding tokens match the context's end."""
    out = set()
    for d, doc in enumerate(docs):
        for pos in range(suffix_module.KEY_LEN, len(doc)):
            n = 0
            while (n < min(suffix_module.MAX_MATCH, len(context)) and pos - n - 1 >= 0
                   and doc[pos - n - 1] == context[-n - 1]):
                n += 1
            if n >= max(suffix_module.MIN_MATCH, suffix_module.KEY_LEN):
                out.add((n, d, tuple(doc[pos:pos + suffix_module.MAX_MATCH])))
    return out


@pytest.mark.parametrize("seed", range(20))
def test_index_lookups_equal_brute_force(seed):
    rng = random.Random(seed)
    docs = [[rng.randrange(6) for _ in range(rng.randrange(3, 60))] for _ in range(5)]
    index = SuffixIndex(max_tokens=10_000)
    for doc in docs:
        index.add(doc)
    context = [rng.randrange(6) for _ in range(rng.randrange(2, 12))]
    got = {(n, d, tuple(c)) for n, d, c in index.matches(context)}
    assert got == brute_matches(docs, context)


def test_eviction_keeps_the_newest_outputs_within_the_bound_and_compacts():
    index = SuffixIndex(max_tokens=25)
    for i in range(10):
        index.add([100 + i, 1, 2, 3, 4, 5, 6, 7, 8, 9])  # 10 tokens each: two fit
        assert index.num_tokens <= 25
    assert list(index.docs) == [8, 9]
    assert {d for n, d, c in index.matches([1, 2, 3])} == {8, 9}
    live = sum(len(v) for v in index.table.values())
    assert live <= 3 * 2 * 10  # evicted outputs' entries are compacted away, not kept forever
    index.add(list(range(40)))  # longer than the bound: not indexed
    assert list(index.docs) == [8, 9]


def test_ranking_prefers_longer_then_own_then_recent_and_caps_the_depth():
    own = [(3, 10, [7, 7, 7, 7, 7, 7, 7, 7])]
    shared = [(5, 1, [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11]), (3, 2, [9, 9, 9, 9, 9, 9, 9, 9])]
    conts = rank_matches(own, shared)
    assert conts[0] == [1, 2, 3, 4, 5, 6, 7, 8, 9, 10]  # the longest match, cut to SPEC_FACTOR x 5
    assert conts[1][0] == 7 and conts[2][0] == 9  # equal lengths: the request's own first
    assert len(conts[0]) == SPEC_FACTOR * 5
    assert suffix_chain(conts, 4) == [1, 2, 3, 4] and suffix_chain([], 4) == [] and suffix_chain(conts, 0) == []


class Seq:
    def __init__(self, seq_id, tokens, output, tenant=None):
        self.seq_id, self.tenant = seq_id, tenant
        self.all_token_ids = tokens + output
        self.output_token_ids = output
        self.token_array = np.asarray(self.all_token_ids, dtype=np.int64)
        self.last_token_id = self.all_token_ids[-1]


def test_proposer_indexes_finished_outputs_per_tenant():
    p = SuffixProposer(max_tokens=1000)
    done = Seq(1, [50, 51], [1, 2, 3, 4, 5, 6], tenant="a")
    p.propose([done], [2])
    p.free(1, finished=False)  # preempted: not indexed
    assert not p.indexes["a"].docs
    p.free(1, finished=True)
    asking_a, asking_b = Seq(2, [60, 1, 2], [], tenant="a"), Seq(3, [60, 1, 2], [], tenant="b")
    assert p.propose([asking_a, asking_b], [3, 3]).token_ids == [[3, 4, 5], []]
    shared = SuffixProposer(max_tokens=1000, scope="global")
    shared.propose([done], [2])
    shared.free(1, finished=True)
    assert shared.propose([asking_b], [3]).token_ids == [[3, 4, 5]]


def test_config_errors():
    assert SpeculativeConfig(method="suffix").tree is None  # chains unless asked (recycle alone drafts trees)
    for kw, match in ((dict(suffix_scope="user"), "suffix_scope 'user'"), (dict(suffix_max_tokens=0), ">= 1"),
                      (dict(suffix_max_tokens=True), ">= 1")):
        with pytest.raises(ValueError, match=match):
            SpeculativeConfig(method="suffix", **kw)
    with pytest.raises(ValueError, match="for methods 'suffix' and 'pick'"):
        SpeculativeConfig(method="ngram_table", suffix_scope="global")


def metrics_of(llm, prompt, tenant):
    out = llm.generate(prompt_token_ids=[prompt], sampling_params=SamplingParams(temperature=0, max_tokens=24,
                                                                                 ignore_eos=True), tenant=tenant)[0]
    return out.outputs[0].token_ids, (out.metrics["drafted"], out.metrics["accepted"])


@pytest.mark.parametrize("scope", ["tenant", "global"])
def test_a_tenant_drafts_from_its_own_outputs_only(tiny_pair, scope):
    """Engine level: request P as tenant "a", then as "b" and "a" again. Per tenant, "b" drafts as a fresh engine
    would (nothing of "a" reaches it) and "a" drafts more the second time; with one global index "b" gains too."""
    spec = SpeculativeConfig(method="suffix", num_speculative_tokens=6, suffix_scope=scope)
    prompt = list(range(30, 50))
    fresh = small_llm(tiny_pair[0], dtype="float32", block_size=4, max_model_len=256, speculative=spec)
    tokens, alone = metrics_of(fresh, prompt, "b")
    llm = small_llm(tiny_pair[0], dtype="float32", block_size=4, max_model_len=256, speculative=spec)
    assert metrics_of(llm, prompt, "a") == (tokens, alone)
    again_b, again_a = metrics_of(llm, prompt, "b"), metrics_of(llm, prompt, "a")
    assert again_b[0] == again_a[0] == tokens  # lossless whatever was drafted
    assert again_a[1][1] > alone[1]  # the second time, tenant a's own earlier output is drafted
    if scope == "tenant":
        assert again_b[1] == alone
    else:
        assert again_b[1][1] > alone[1]
    with pytest.raises(ValueError, match="tenant must be None or a non-empty string"):
        llm.generate(prompt_token_ids=[prompt], tenant="")
