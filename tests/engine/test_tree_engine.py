"""Token trees in the engine: trees against chains, compaction across block boundaries, the batch-size policy, a
failing tree request ending alone, seeded tree sampling, and no leaked blocks after random tree rounds (greedy
parity with plain decoding, static and dynamic trees, draft-model and model-free: lossless/test_greedy_parity.py)."""

import pytest
import torch
from helpers import small_llm

from specdec import SamplingParams, SpeculativeConfig
from specdec.spec_decode.round import SpeculativeRound

GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)


def prompts(n, seed=0, lo=3, hi=40, repeat=False):
    gen = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        ids = torch.randint(0, 257, (int(torch.randint(lo, hi, (1,), generator=gen)),), generator=gen).tolist()
        out.append(ids * 2 if repeat else ids)  # repeated text gives prompt lookup / n-gram something to match
    return out


def tree_llm(target, spec: SpeculativeConfig, **kwargs):
    return small_llm(target, dtype="float32", block_size=4, max_model_len=kwargs.pop("max_model_len", 256),
                       speculative=spec, **kwargs)


def assert_no_leak(llm):
    pools = list(llm.engine.block_managers)  # the target's pool, then the draft model's
    for bm in pools:
        bm.check_invariants()
        assert bm.num_free_blocks == bm.num_blocks


def tree_rounds(outs):
    return sum(o.metrics["num_rounds"] for o in outs)


def test_tree_accepts_at_least_the_chain_under_greedy(tiny_pair):
    """The static tree [2, 2, 2] contains the chain's drafts (each node's first child is the draft's argmax),
    so under greedy verification it accepts at least as many tokens per round as the chain of the same depth."""
    ps = prompts(4, seed=9)
    chain = tree_llm(tiny_pair[0], SpeculativeConfig(draft_model=tiny_pair[1], num_speculative_tokens=3))
    tree = tree_llm(tiny_pair[0], SpeculativeConfig(draft_model=tiny_pair[1], num_speculative_tokens=3,
                                                    tree_policy="always", tree=[2, 2, 2]))
    c = chain.generate(prompt_token_ids=ps, sampling_params=GREEDY)
    t = tree.generate(prompt_token_ids=ps, sampling_params=GREEDY)
    assert [o.outputs[0].token_ids for o in c] == [o.outputs[0].token_ids for o in t]
    tau_chain = sum(len(o.outputs[0].token_ids) for o in c) / tree_rounds(c)
    tau_tree = sum(len(o.outputs[0].token_ids) for o in t) / tree_rounds(t)
    assert tau_tree >= tau_chain


def test_large_batches_draft_chains(tiny_pair, tiny_pair_plain):
    """Above tree_max_batch_size the same engine drafts chains (the policy of docs/architecture.md)."""
    ps = prompts(4, seed=10)
    ref = [o.outputs[0].token_ids for o in tiny_pair_plain.generate(prompt_token_ids=ps, sampling_params=GREEDY)]
    spec = SpeculativeConfig(draft_model=tiny_pair[1], num_speculative_tokens=3, tree_policy="always", tree=[3, 1, 1],
                             tree_max_batch_size=2)
    llm = tree_llm(tiny_pair[0], spec, max_num_seqs=4)
    seen = []
    original = llm.engine.speculative.proposer.propose_tree

    def spy(seqs, *args):
        seen.append(len(seqs))
        return original(seqs, *args)

    llm.engine.speculative.proposer.propose_tree = spy
    outs = llm.generate(prompt_token_ids=ps, sampling_params=GREEDY)
    assert [o.outputs[0].token_ids for o in outs] == ref
    assert seen and max(seen) <= 2  # trees only in steps with <= 2 running requests
    assert_no_leak(llm)


def test_random_tree_rounds_leak_nothing(tiny_pair):
    """Random prompts, lengths, parameters and aborts with sampled trees: every block returns to both pools."""
    gen = torch.Generator().manual_seed(11)
    spec = SpeculativeConfig(draft_model=tiny_pair[1], num_speculative_tokens=4, tree_policy="always", tree="dynamic",
                             tree_budget=9)
    llm = tree_llm(tiny_pair[0], spec, max_num_seqs=3, max_num_batched_tokens=32, max_model_len=96)
    engine = llm.engine
    for i, ids in enumerate(prompts(8, seed=12, lo=2, hi=50)):
        t = float(torch.rand(1, generator=gen)) * 1.2
        engine.add_request(request_id=f"r{i}", prompt_token_ids=ids, params=SamplingParams(
            temperature=t if t > 0.2 else 0.0, top_k=int(torch.randint(0, 20, (1,), generator=gen)),
            max_tokens=int(torch.randint(1, 40, (1,), generator=gen)), seed=i, ignore_eos=True))
    steps = 0
    while engine.has_unfinished_requests():
        engine.step()
        steps += 1
        if steps == 5:
            engine.abort("r1")
        assert steps < 500
    assert engine.stats.get("failed_requests", 0) == 0
    assert_no_leak(llm)


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=0, max_tokens=30, ignore_eos=True),
    SamplingParams(temperature=0.8, top_k=30, max_tokens=30, ignore_eos=True, seed=3),
])
def test_self_speculation_with_trees_accepts_every_level(tiny_pair, params):
    """Draft = target: the first child at every node is what the target would emit (greedy: its argmax; sampled:
    p = q accepts the first child surely), so every round accepts the full depth - which also holds only if
    the draft's cache was compacted correctly after each round (a stale or misplaced K/V changes its q)."""
    target = tiny_pair[0]
    llm = tree_llm(target, SpeculativeConfig(draft_model=target, num_speculative_tokens=3, tree_policy="always",
                                             tree=[2, 2, 1]), enable_prefix_caching=False)
    outs = llm.generate(prompt_token_ids=prompts(3, seed=13), sampling_params=params)
    for o in outs:
        m = o.metrics
        assert m["num_rounds"] > 0 and m["accepted"] == m["drafted"], m
    assert_no_leak(llm)


def test_a_failing_tree_request_ends_alone(tiny_pair, tiny_pair_plain, monkeypatch):
    """A fault in one request's tree verification ends that request with "error"; the others produce the
    target-only greedy tokens and every block returns to both pools."""
    ps = prompts(4, seed=14)
    ref = [o.outputs[0].token_ids for o in tiny_pair_plain.generate(prompt_token_ids=ps, sampling_params=GREEDY)]
    llm = tree_llm(tiny_pair[0], SpeculativeConfig(draft_model=tiny_pair[1], num_speculative_tokens=3,
                                                   tree_policy="always", tree=[2, 1, 1]), max_num_seqs=4)
    victim = ps[2]
    real = SpeculativeRound.verify

    def faulty(self, logits, out):
        assert self.meta.trees is not None, "a chain round: the test would prove nothing about trees"
        if any(s.prompt_token_ids == victim and len(s.output_token_ids) >= 3 for s in self.requests):
            raise RuntimeError("tree verification failed for the victim")
        return real(self, logits, out)

    monkeypatch.setattr(SpeculativeRound, "verify", faulty)
    outs = llm.generate(prompt_token_ids=ps, sampling_params=GREEDY)
    assert outs[2].outputs[0].finish_reason == "error" and "victim" in outs[2].error
    assert [o.outputs[0].token_ids for i, o in enumerate(outs) if i != 2] == [r for i, r in enumerate(ref) if i != 2]
    assert_no_leak(llm)


@pytest.mark.parametrize("tree", [[3, 1, 1], "dynamic"])
def test_seeded_tree_sampling_reproduces_whatever_the_batch(tiny_pair, tree):
    """fp32 CPU: a seeded sampled request drafts and verifies the same trees alone and batched with others."""
    spec = SpeculativeConfig(draft_model=tiny_pair[1], num_speculative_tokens=3, tree_policy="always", tree=tree,
                             tree_budget=8)
    llm = tree_llm(tiny_pair[0], spec, enable_prefix_caching=False)
    target = prompts(1, seed=20)[0]
    params = SamplingParams(temperature=0.9, top_p=0.95, max_tokens=24, seed=42, ignore_eos=True)
    others, other_params = prompts(3, seed=21), SamplingParams(temperature=1.0, max_tokens=30, ignore_eos=True)
    alone = llm.generate(prompt_token_ids=target, sampling_params=params)[0].outputs[0].token_ids
    batched = llm.generate(prompt_token_ids=[target] + others, sampling_params=[params] + [other_params] * 3)
    assert batched[0].outputs[0].token_ids == alone


@pytest.mark.parametrize("adaptive", [False, True])
@pytest.mark.parametrize("tree_window_cost", [0.0, 50.0])
def test_measured_tree_policy_drafts_trees_only_where_they_pay(tiny_pair, tiny_pair_plain, adaptive, tree_window_cost):
    """tree_policy="measured" (the default): each round drafts the tree or the chain by value (injected costs here:
    a chain window of k + 1 tokens costs 1 + 0.1 k decodes). Tree windows that cost a decode whatever their size:
    trees are drafted in most rounds; 50x dearer per node: only in exploration rounds. Either way the tokens are the
    target-only greedy tokens and no block leaks."""
    from specdec.spec_decode.cost_model import FixedCostModel

    ps = prompts(2, seed=21)
    costs = FixedCostModel(c=0.0, verify_slope=0.1, tree_verify_factor=tree_window_cost)
    spec = SpeculativeConfig(draft_model=tiny_pair[1], num_speculative_tokens=3, tree=[2, 2, 1], cost_model=costs,
                             adaptive=adaptive)
    llm = tree_llm(tiny_pair[0], spec, max_num_seqs=1)
    calls = {"tree": 0, "chain": 0}
    proposer = llm.engine.speculative.proposer
    propose, propose_tree = proposer.propose, proposer.propose_tree

    def spy_chain(*args):
        calls["chain"] += 1
        return propose(*args)

    def spy_tree(*args):
        calls["tree"] += 1
        return propose_tree(*args)

    proposer.propose, proposer.propose_tree = spy_chain, spy_tree
    params = SamplingParams(temperature=0, max_tokens=80, ignore_eos=True)
    ref = [o.outputs[0].token_ids for o in tiny_pair_plain.generate(prompt_token_ids=ps, sampling_params=params)]
    outs = llm.generate(prompt_token_ids=ps, sampling_params=params)
    assert [o.outputs[0].token_ids for o in outs] == ref
    rounds = calls["tree"] + calls["chain"]
    assert rounds > 0
    if tree_window_cost == 0.0:
        assert calls["tree"] >= 0.6 * rounds, calls
    else:
        assert 0 < calls["tree"] <= rounds / 8, calls  # measured (explored), then left alone
    assert_no_leak(llm)
