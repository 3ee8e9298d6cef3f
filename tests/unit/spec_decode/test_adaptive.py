"""Adaptive k: outlier-robust measured costs (warm-up rule, median window) and deterministic exploration."""

from collections import Counter

import pytest

from specdec.spec_decode.adaptive import AdaptiveK
from specdec.spec_decode.cost_model import FixedCostModel, MeasuredCostModel, expected_speedup

# true costs at batch 1: a target forward of n tokens takes A + B*n seconds, one draft step C seconds
A, B, C = 0.010, 0.0002, 0.001


def simulate(adaptive_k=AdaptiveK, cost_model=MeasuredCostModel, decisions=2000, k_cap=4, k4_outliers=(1,),
             later_outliers=(1000,), draft_outliers=()):
    """One request, every draft accepted; the cost model is fed the timings of what was chosen, as the engine
    does (a target forward of k+1 tokens; k-1 timed draft steps: the first draft forward includes catch-up and is
    not timed). ``k4_outliers``: which measurements of k = 4 (1 = the first) take 100x; ``later_outliers``: which
    decisions' target timing takes 100x, whatever k; ``draft_outliers``: which draft timings take 100x."""
    costs = cost_model()
    ada = adaptive_k(k_max=k_cap, cost_model=costs)
    choices, k4_seen, drafts = [], 0, 0
    for i in range(decisions):
        k = ada.choose(0, 1, k_cap)
        seconds = A + B * (k + 1)
        if k == 4:
            k4_seen += 1
            seconds *= 100 if k4_seen in k4_outliers else 1
        seconds *= 100 if i in later_outliers else 1
        costs.observe_target(1, k + 1, seconds)
        for _ in range(k - 1):
            drafts += 1
            costs.observe_draft(1, C * (100 if drafts in draft_outliers else 1))
        if k:
            ada.observe(0, drafted=k, accepted=k)
        choices.append(k)
    return choices


def true_best_k(k_cap=4):
    c = C / (A + B)
    return max(range(k_cap + 1), key=lambda k: expected_speedup(1.0, k, c, (A + B * (k + 1)) / (A + B)))


@pytest.mark.parametrize("outliers", [
    {},  # the first k = 4 measurement and decision 1000 take 100x
    {"k4_outliers": (1, 2, 3), "later_outliers": tuple(range(500, 520))},  # repeated outliers, a noisy burst
    {"draft_outliers": (2, 3, 4)},  # the first real draft timings too
], ids=["one_then_one", "burst", "draft"])
def test_one_outlier_does_not_lock_a_k_out(outliers):
    best = true_best_k()
    assert best == 4
    last = Counter(simulate(**outliers)[-1000:])
    assert last[best] >= 900, last  # the old EMA model chose k=1 999 times of these 1000 and never 4
    assert last[3] > 0 and last[1] == last[2] == 0, last  # the best's neighbour keeps being re-measured, no other


def test_median_window_ignores_an_outlier_and_the_warm_up_sample():
    cm = MeasuredCostModel()
    for n, t in ((1, 0.010), (3, 0.012)):
        cm.observe_target(1, n, 5.0)  # warm-up (a JIT compile): discarded
        for _ in range(4):
            cm.observe_target(1, n, t)
        cm.observe_target(1, n, 100 * t)  # one noisy-neighbour outlier among five
    assert cm.verify_cost(2, 1) == pytest.approx(1.2)
    # a key seen once is only a warm-up sample: k = 4 (5 tokens) comes from the line, not from the 100 s
    cm.observe_target(1, 5, 100.0)
    assert cm.verify_cost(4, 1) == pytest.approx(1.4)
    # one or two samples past warm-up (lower median: the smaller) do not outvote the line either
    cm.observe_target(1, 5, 0.5)
    cm.observe_target(1, 5, 0.014)
    assert cm.verify_cost(4, 1) == pytest.approx(1.4)
    cm.observe_draft(1, 9.0)  # warm-up
    for t in (0.003, 0.003, 0.3, 0.003):
        cm.observe_draft(1, t)
    assert cm.draft_cost(1) == pytest.approx(0.3)
    # the window follows a real change: 8 samples at a new speed replace the old ones
    for _ in range(8):
        cm.observe_target(1, 1, 0.020)
    assert cm.draft_cost(1) == pytest.approx(0.15)  # the draft step, relative to the new decode time


def test_warm_up_samples_stand_in_only_while_a_batch_size_has_nothing_else():
    cm = MeasuredCostModel()
    assert cm.verify_cost(2, 1) == pytest.approx(1.2)  # prior
    cm.observe_target(1, 1, 0.010)
    cm.observe_target(1, 3, 0.014)
    assert cm.verify_cost(2, 1) == pytest.approx(1.4)  # warm-up samples, nothing better yet
    cm.observe_target(1, 1, 0.010)  # a real sample: the warm-up ones no longer make the line
    assert cm.verify_cost(2, 1) == pytest.approx(1.4)  # one point, no line: the key's own (warm-up) sample
    assert cm.verify_cost(3, 1) == pytest.approx(1.3)  # nothing at 4 tokens: the prior
    cm.observe_draft(1, 0.004)
    assert cm.draft_cost(1) == pytest.approx(0.4)
    cm.observe_draft(1, 0.002)
    assert cm.draft_cost(1) == pytest.approx(0.2)


def _run(costs, decisions, k_cap=4, **kwargs):
    # no rounds observed: the schedule only, at a prior acceptance of 0.5 (1:1)
    ada = AdaptiveK(k_max=k_cap, cost_model=costs, optimism=0.0, prior_accepted=1.0, prior_rejected=1.0, **kwargs)
    return [ada.choose(0, 1, k_cap) for _ in range(decisions)]


def test_exploration_visits_the_neighbours_of_the_best_deterministically_and_rarely():
    costs = FixedCostModel(c=0.0, verify_slope=0.14)  # at the prior alpha 0.5, k = 2 is best
    assert max(range(5), key=lambda k: expected_speedup(0.5, k, 0.0, 1 + 0.14 * k)) == 2
    choices = _run(costs, 160)
    counts = Counter(choices)
    assert counts[1] >= 1 and counts[3] >= 1 and counts[4] == 0  # k = 2's neighbours, not the far k = 4
    assert counts[2] == 150  # 1 round in 16 explores
    assert choices == _run(costs, 160)  # no clock, no randomness
    assert set(_run(costs, 160, explore_every=0)) == {2}


def test_short_requests_still_explore():
    """Exploration is staggered across requests, so requests shorter than 16 decisions explore too."""
    ada = AdaptiveK(k_max=4, cost_model=FixedCostModel(c=0.0, verify_slope=0.14), optimism=0.0,
                    prior_accepted=1.0, prior_rejected=1.0)  # at the prior 0.5, k = 2 is best
    choices = []
    for seq in range(32):
        choices += [ada.choose(seq, 1, 4) for _ in range(6)]
        ada.free(seq)
    counts = Counter(choices)
    assert counts[1] >= 1 and counts[3] >= 1 and counts[2] >= 0.9 * len(choices)


def test_speculation_off_with_periodic_probes():
    # a pricey draft: off; probes after 2 plain steps, then 4, 8, ... up to every probe_every, alternating the
    # best-valued k >= 1 (here 1) and the k >= 1 gone longest without (ties: the larger), so every k is measured again
    choices = _run(FixedCostModel(c=5.0), 64, probe_every=4)
    assert [i for i, k in enumerate(choices) if k] == [1, *range(5, 64, 4)]
    assert [k for k in choices if k] == [1, 4, 1, 3, 1, 2] * 2 + [1, 4, 1, 3]
    choices = _run(FixedCostModel(c=5.0), 100, probe_every=16)
    assert [i for i, k in enumerate(choices) if k] == [1, 5, 13, 29, 45, 61, 77, 93]  # gaps 2, 4, 8, then 16
    # a free drafter whose verification does not pay: off, the same probes
    choices = _run(FixedCostModel(c=0.0, verify_slope=2.0), 64, probe_every=4)
    assert choices.count(0) == 48 and set(choices) == {0, 1, 2, 3, 4}


# --- from any start: k = 0 on a high-acceptance stream whose short windows are slow ---------------------------
# A target forward of n tokens (one request) costs T[n] target-decode units: on CPU a 2- or 3-row float32 GEMM
# without a packed weight can cost several decodes while a 5-row one with it costs ~1 (measured on an AMD EPYC:
# docs/benchmarks.md, "Adaptive k"); one draft step costs 0.3.
SLOW_SHORT = {1: 1.0, 2: 3.0, 3: 3.5, 4: 1.05, 5: 1.1}


def simulate_stream(accept, decisions=600, k_cap=4, target=SLOW_SHORT, draft=0.3, adaptive_k=AdaptiveK,
                    cost_model=MeasuredCostModel):
    """One request; ``accept(j)`` says whether draft j (1-based) of a round is accepted (a deterministic stream).
    The cost model is fed what was chosen, as the engine does: the target forward of k + 1 tokens, k - 1 timed draft
    steps. It starts having seen only slow k = 1 rounds (what an engine on such a CPU measures first)."""
    costs = cost_model()
    ada = adaptive_k(k_max=k_cap, cost_model=costs)
    for _ in range(4):  # the start: k = 1 windows measured slow, decodes fast, a k = 1 round accepted
        costs.observe_target(1, 2, target[2])
        costs.observe_target(1, 1, target[1])
    choices = []
    for _ in range(decisions):
        k = ada.choose(0, 1, k_cap)
        costs.observe_target(1, k + 1, target[k + 1])
        for _ in range(k - 1):
            costs.observe_draft(1, draft)
        if k:
            accepted = 0
            while accepted < k and accept(accepted + 1):
                accepted += 1
            ada.observe(0, drafted=k, accepted=accepted)
        choices.append(k)
    return choices


def best_fixed_k(accept_prob, k_cap=4, target=SLOW_SHORT, draft=0.3):
    """The k with the most tokens per unit of time for per-position acceptance ``accept_prob[j - 1]``."""
    def value(k):
        tokens, survive = 1.0, 1.0
        for j in range(k):
            survive *= accept_prob[j]
            tokens += survive
        return tokens / (k * draft + target[k + 1] / target[1])
    return max(range(k_cap + 1), key=value)


def test_from_k0_it_climbs_to_the_long_k_that_pays():
    """Every draft accepted, k = 1 and 2 windows slow, k = 4 cheap: the best k is 4. The old probes (k = 1 only,
    sometimes 2) never measured k = 4 and stayed at k = 0 (run against the previous adaptive.py: k = 0 in 281 of
    the last 300 decisions, the other 19 its k = 1 / 2 probes)."""
    assert best_fixed_k([1.0] * 4) == 4
    last = Counter(simulate_stream(lambda j: True)[-300:])
    assert last[4] >= 0.9 * 300, last


def test_per_position_acceptance_prices_a_structured_prefix():
    """Drafts 1-2 always accepted, 3-4 never (a structured prefix, a free tail): the best k is 2 and the per-position
    estimates find it (the previous adaptive.py, one pooled alpha: k = 2 in 137 of the last 300 decisions, k = 3 in
    144)."""
    flat = {n: 1.0 + 0.02 * n for n in range(1, 6)}
    best = best_fixed_k([1.0, 1.0, 0.0, 0.0], target=flat)
    assert best == 2
    last = Counter(simulate_stream(lambda j: j <= 2, target=flat)[-300:])
    assert last[2] >= 0.85 * 300, last
    ada = AdaptiveK(k_max=4, cost_model=FixedCostModel())
    for _ in range(30):
        ada.observe(0, drafted=4, accepted=2)
    r = ada.position_acceptance(0)
    assert r[0] > 0.9 and r[1] > 0.9 and r[2] < 0.15  # position 3 reached and rejected every time
    assert ada.expected_tokens(0, 4) == pytest.approx(1 + r[0] + r[0] * r[1] + r[0] * r[1] * r[2] +
                                                      r[0] * r[1] * r[2] * r[3])


# --- trees: chosen by their measured yield and costs --------------------------------------------------------
def simulate_trees(costs, chain_accept, tree_tokens, decisions=400, k_cap=3, adapt_depth=False, nodes=lambda d: 3 * d):
    """One request with trees allowed. A chain round of k accepts its first ``chain_accept(j)`` drafts; a tree round
    of depth d emits ``tree_tokens(d)`` tokens. Returns the arms chosen."""
    ada = AdaptiveK(k_max=k_cap, cost_model=costs, tree_nodes=nodes, adapt_depth=adapt_depth)
    arms = []
    for _ in range(decisions):
        arm = ada.choose_arm(0, 1, k_cap, trees=True)
        if arm.depth and arm.tree:
            ada.observe(0, drafted=arm.depth, accepted=tree_tokens(arm.depth) - 1, tree=True)
        elif arm.depth:
            accepted = 0
            while accepted < arm.depth and chain_accept(accepted + 1):
                accepted += 1
            ada.observe(0, drafted=arm.depth, accepted=accepted)
        arms.append(arm)
    return arms


def test_a_tree_that_does_not_pay_for_its_window_is_not_drafted():
    """Chains accept 2 of 3 (3 tokens a round for 1 + 3 * 0.05 units); a tree of depth 3 emits 3.3 tokens but its
    9-node window costs 3x a chain window: value 3 / 1.29 = 2.3 against 3.3 / 2.05 = 1.6. After exploring it, the
    chain is chosen (a tree never runs where a chain does better) - with fixed depth and with adaptive depth."""
    costs = FixedCostModel(c=0.0, verify_slope=0.05, tree_verify_factor=3.0)
    for adapt in (False, True):
        arms = simulate_trees(costs, lambda j: j <= 2, lambda d: min(d, 2) + 1.3, adapt_depth=adapt)
        last = Counter(arms[-200:])
        assert sum(n for a, n in last.items() if a.tree) <= 200 / 16 + 2, last  # exploration only
        assert any(a.tree for a in arms), "the tree arm was never measured"


def test_a_tree_that_pays_is_drafted():
    """Chains accept 1 draft (2 tokens a round); a depth-3 tree emits 3.5 tokens and its window costs little more:
    the tree wins, 3.5 / 1.18 = 3.0 against 2 / 1.06 = 1.9 (verify_slope 0.02, tree windows 1x)."""
    costs = FixedCostModel(c=0.0, verify_slope=0.02)
    arms = simulate_trees(costs, lambda j: j <= 1, lambda d: d + 0.5)
    last = Counter(arms[-200:])
    assert last[(3, True)] >= 0.9 * 200, last


def test_trees_are_measured_not_assumed():
    """Before any tree round the tree's yield leans on the chain's (a lower bound), so a costlier tree window is
    not chosen on faith: the first drafting decision is the chain."""
    ada = AdaptiveK(k_max=3, cost_model=FixedCostModel(c=0.0, verify_slope=0.05), tree_nodes=lambda d: 3 * d,
                    adapt_depth=False)
    assert ada.choose_arm(0, 1, 3, trees=True) == (3, False)
    assert ada.expected_tree_tokens(0, 3) == pytest.approx(ada.expected_tokens(0, 3, optimistic=True))
    for _ in range(20):
        ada.observe(0, drafted=3, accepted=3, tree=True)
    assert ada.expected_tree_tokens(0, 3) > 3.5


def test_cpu_forwards_are_timed_by_thread_cpu_time_with_one_thread():
    """With one intra-op thread a forward is timed by its thread's CPU time, so time the thread spends off the CPU
    (here a sleep; on a shared machine, preemption) is not charged to it; with several threads, by wall time."""
    import time

    import torch

    from specdec.spec_decode.forward_timer import ForwardTimer

    threads = torch.get_num_threads()
    timer, recorded = ForwardTimer(), []
    try:
        for n in (1, 2):
            torch.set_num_threads(n)
            start = timer.start(torch.device("cpu"))
            time.sleep(0.05)
            timer.stop(start, recorded.append)
    finally:
        torch.set_num_threads(threads)
    assert recorded[0] < 0.025 <= 0.05 <= recorded[1], recorded


@pytest.mark.parametrize("optimism", [1.0, 0.0])
def test_one_early_rejection_does_not_park_a_request_at_a_short_k(optimism):
    """A code-like stream (every draft accepted) whose first chain of 2 was rejected at position 2, with costs that
    make k = 4 best (c = 0.25, flat verification). With optimism the request drafts k = 4 from its next decision
    on; the point estimates alone (optimism 0, the previous rule) start again at k = 1 and climb one step at a time
    (on the Qwen pair, with its measured costs, they stayed at k = 1 for 14 of the first 16 decisions)."""
    ada = AdaptiveK(k_max=4, cost_model=FixedCostModel(c=0.25, verify_slope=0.0), optimism=optimism)
    ada.observe(0, drafted=1, accepted=1)
    ada.observe(0, drafted=2, accepted=1)  # the unlucky round: position 2 rejected once
    chosen = []
    for _ in range(16):
        k = ada.choose(0, 1, 4)
        chosen.append(k)
        if k:
            ada.observe(0, drafted=k, accepted=k)
    if optimism:
        assert chosen[:4] == [4, 4, 4, 4], chosen
    else:  # the mutant: the old rule is caught by the same assertion
        assert chosen[:4] != [4, 4, 4, 4] and min(chosen[:4]) <= 2, chosen


@pytest.mark.parametrize("min_rounds", [8, 0])
def test_an_unlucky_start_does_not_turn_speculation_off(min_rounds):
    """Prose on the Qwen pair in float32 (c = 0.33, v = 1.07 / 0.75 / 0.78 / 0.70: the calibrated costs): drafting
    pays from acceptance ~0.3, but a request whose first rounds were rejected estimated position 1 far below that,
    went plain and - probed every 2, 4, 8, then 16 steps - spent most of its first ~140 steps plain (one measured
    256-token answer, whose draft matched the target at 0.64 of positions). With ``min_rounds`` (8) its first 8
    decisions draft; the mutant (0) turns off after 3."""
    costs = {1: 1.07, 2: 0.75, 3: 0.78, 4: 0.70}

    class Calibrated(FixedCostModel):
        def verify_cost(self, k, batch_size):
            return costs.get(k, 1.0)

    ada = AdaptiveK(k_max=4, cost_model=Calibrated(c=0.33), min_rounds=min_rounds)
    chosen = []
    for _ in range(12):
        k = ada.choose(0, 1, 4)
        chosen.append(k)
        if k:
            ada.observe(0, drafted=k, accepted=0)  # an unlucky stretch: every first draft rejected
    if min_rounds:
        assert all(chosen[:8]) and chosen[8] == 0, chosen  # 8 measured rounds, then off (it truly does not pay)
    else:
        assert chosen.index(0) <= 3, chosen


def test_a_drafter_that_cannot_pay_even_when_every_draft_is_accepted_is_off_at_once():
    """No young-request rounds where k + 1 tokens would not pay for the round (c = 5): off from the first decision."""
    ada = AdaptiveK(k_max=4, cost_model=FixedCostModel(c=5.0))
    assert ada.choose(0, 1, 4) == 0
