"""Method "pick": the choice among model-free drafters by expected accepted tokens, the outcome accounting at the
commit, and the engine picking the drafter that pays on text where one of them clearly wins."""

from __future__ import annotations

import pytest
from helpers import small_llm

from specdec import SamplingParams, SpeculativeConfig
from specdec.spec_decode.proposers.base import DraftProposal, ModelFreeProposer
from specdec.spec_decode.proposers.pick import PRIOR_RATE, PickProposer, expected_tokens


class Fixed(ModelFreeProposer):
    """Proposes a fixed chain for every request (cut to k)."""

    def __init__(self, chain):
        self.chain = chain
        self.freed = []

    def propose(self, seqs, num_tokens):
        return DraftProposal([self.chain[:k] for k in num_tokens], None, [True] * len(seqs))

    def free(self, seq_id, finished):
        self.freed.append((seq_id, finished))


class Seq:
    def __init__(self, seq_id, num_computed=10):
        self.seq_id, self.num_computed = seq_id, num_computed


def test_expected_tokens():
    assert expected_tokens(0.5, 3) == pytest.approx(0.875)
    assert expected_tokens(1.0, 4) == 4 and expected_tokens(0.0, 4) == 0 and expected_tokens(0.7, 0) == 0


def test_picks_by_expected_tokens_and_learns_from_outcomes():
    short, long, none = Fixed([1, 2]), Fixed([3, 4, 5, 6]), Fixed([])
    pick = PickProposer({"none": none, "short": short, "long": long})
    seq = Seq(7)
    assert pick.propose([seq], [4]).token_ids == [[3, 4, 5, 6]]  # equal priors: the longer chain is worth more
    pick.rollback(seq, seq.num_computed + 1 + 0)  # long: 0 of 4 accepted
    assert pick.rate(7, "long") < PRIOR_RATE and pick.engine_counts["long"] == [0, 4]
    for _ in range(3):
        pick.propose([seq], [4])
        pick.rollback(seq, seq.num_computed + 1)  # whatever it picks: rejected at once
    assert pick.engine_counts["short"][1] > 0  # it moved on to the other drafter
    pick.pending.clear()
    pick.request_counts[7] = {"short": [20, 20], "long": [0, 40]}
    assert pick.propose([seq], [4]).token_ids == [[1, 2]]
    # another request starts from the engine-wide rate (shrunk towards the prior), not from request 7's own
    accepted, drafted = pick.engine_counts["long"]
    assert pick.rate(8, "long") == pytest.approx((accepted + PRIOR_RATE * 4) / (drafted + 4))


def test_discard_forgets_the_round_and_free_reaches_every_drafter():
    a, b = Fixed([1]), Fixed([2, 3])
    pick = PickProposer({"a": a, "b": b})
    seq = Seq(1)
    pick.propose([seq], [2])
    pick.discard(seq, 10)
    pick.rollback(seq, 13)  # nothing pending: no outcome counted
    assert pick.engine_counts == {"a": [0, 0], "b": [0, 0]}
    pick.free(1, finished=True)
    assert a.freed == b.freed == [(1, True)]


def test_the_engine_picks_the_drafter_that_pays(tiny_pair):
    """A repetitive prompt: every drafter finds something; outcomes steer the picks, and the output is the plain
    greedy output whatever was picked."""
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    prompt = [5, 9, 12, 7] * 6
    plain = small_llm(tiny_pair[0], dtype="float32", block_size=4, max_model_len=256)
    expected = plain.generate(prompt_token_ids=[prompt], sampling_params=params)[0].outputs[0].token_ids
    llm = small_llm(tiny_pair[0], dtype="float32", block_size=4, max_model_len=256,
                    speculative=SpeculativeConfig(method="pick", num_speculative_tokens=4, tree="dynamic",
                                                  tree_policy="always"))
    out = llm.generate(prompt_token_ids=[prompt, prompt], sampling_params=params)
    assert [o.outputs[0].token_ids for o in out] == [expected, expected]
    proposer = llm.engine.speculative.proposer
    assert sum(proposer.picks.values()) > 0 and sum(o.metrics["accepted"] for o in out) > 0
    drafted = {name: c[1] for name, c in proposer.engine_counts.items()}
    assert sum(drafted.values()) == sum(o.metrics["drafted"] for o in out)  # every verified round was accounted
