"""Adaptive speculation: per request and step, the arm - a plain step, a chain of k drafts, or a token tree of
depth d - with the most expected tokens per unit of measured time.

**Chains.** Drafting k tokens yields ``E(k) = 1 + sum_{i=1..k} prod_{j<=i} r_j`` tokens in expectation, where r_j is
the probability that draft j is accepted given drafts 1..j-1 were (Leviathan et al., eq. 1 is the case r_j = alpha
for every j), and costs ``k*c + v(k)`` target-step units, where c is one draft step relative to one target decode
step (~0 for model-free drafters) and v(k) the target's cost for k+1 tokens per request relative to 1 token (v(0) =
1): value ``E(k) / (k c + v(k))`` (a plain step: value 1). Costs come from ``cost_model.py``.

**Acceptance per position.** Every verified chain round tells, for each position it reached, whether the draft
there was accepted: a round that drafted d tokens and accepted a reached positions 1..min(a + 1, d). Each request
keeps decayed counts per position (reached, accepted; a position forgets only as it is measured again), so r_j is
known at every position any round has reached, also from rounds that drafted fewer than k tokens; a position with
little data leans on the request's pooled acceptance (all positions together) with the weight of ``prior_weight``
rounds. A structured prefix with a free tail (acceptance 1.0 at position 1, 0.2 at position 4) is then priced per
position instead of by one average.

**The prior: 2/3 before anything is known** (``prior_accepted`` 2, ``prior_rejected`` 1: pseudo-counts of drafts in
the pooled estimate, a draft accepted two times in three - the range a draft model is chosen for; the Qwen pair's
draft matches its target at 0.63-0.76 of prose positions and 0.81-1.0 of structured ones in the 16 traces). With 1:1
(0.5, before) a young request started at k = 2 on the float32 Qwen pair and one rejection sent it back there, so a
structured answer spent its first rounds climbing to k = 4; prose's first rounds, often its hardest, pulled the
estimate under the break-even and turned speculation off for dozens of steps. End to end (float32, 128 tokens, 3
repetitions, lockstep; bench/results/adaptive_k_20261128/README.md) 2:1 against 1:1: code 1.005 / 1.006, json 1.008
/ 0.953, copy 0.975 / 0.947, prose 0.994 / 0.876 of the best fixed k.

**Trees** (``tree_nodes`` given: the configured tree's drafted nodes at depth d). A tree of depth d emits ``T(d)``
tokens per round, estimated per request as the decayed mean of its tree rounds at that depth, leaning (weight
``prior_weight``) on the chain's E(d) - a lower bound: the tree holds the chain's candidates and more - and costs
the measured tree drafting plus the tree window's forward (``tree_draft_cost(d) + tree_verify_cost(nodes(d))``).
So a tree is chosen only when it has been measured to emit enough more than the chain to pay for its bigger window
and its drafting: on a CPU where a 13-token window costs far more than a decode it is not, where the window is
nearly free (a GPU at small batch) it can be. ``adapt_depth=False`` (a tree configured without ``adaptive=True``)
keeps the depth at the cap and only chooses tree or chain there, never a plain step.

**Probes back off.** The first probe after a request turns speculation off comes 2 plain steps later, the next 4,
then 8, then every ``probe_every``: a request whose early rounds were unlucky (or whose text changes) finds its
way back within a few steps, and one where drafting does not pay spends about one probe round in 16 once settled.
The gap starts again at 2 whenever the request chooses to draft by itself.

**From any start.** The engine calibrates the cost model before the first request (``calibration.py``: every window
length's forward and the draft step, at batch 1), so the first choices weigh measured costs. A plain step (k = 0)
switches speculation off for the request; after 2, 4, 8, then every ``probe_every`` plain steps it drafts once to re-
measure. A probe takes the drafting arm the estimates value most - or, every other probe, the arm this batch size has
gone longest without (ties: the deeper) - so the costs and acceptances of every arm get measured again. An engine that
found short windows slow (on CPU a 2- or 3-row float32 GEMM can cost as much as a 5-row one or more) therefore still
finds a long k that pays: probing only k = 1 - what this module did before - could never climb out of k = 0 there.

**Not off on a few rounds.** A request's first ``min_rounds`` (8) decisions draft - unless no drafting arm would pay
even with every draft accepted, or that many of its rounds have been measured already - so it turns speculation off
only on some evidence of its own. A plain step measures nothing, so a request
that turned off on two or three unlucky rounds stayed off between sparse probes: on the Qwen pair in float32 a prose
answer whose draft matched the target at 0.64 of positions (drafting pays from ~0.3) spent most of its first ~140
steps plain.

**Optimism.** Choices weigh each position's acceptance plus ``optimism`` (0.5) standard errors of its estimate,
``sqrt(r (1 - r) / (n + prior_weight))`` with n the rounds that ever reached the position (not decayed) - the
upper-confidence rule of bandit problems. A position drafted rarely or never looks better than its point estimate, so a
young request tries the longer chains early (one early rejection cannot park it at a short k, as it did when position 2
of a code prompt was rejected once and the chain stayed at k = 1 for 14 steps), and the bonus fades as the request's own
rounds accumulate. Half a standard error, not one: on prose, where positions 3-4 are rarely reached, a full one kept
their bonus large and drafted long chains into hard stretches - replayed on 16 measured traces of the Qwen pair
(tests/unit/spec_decode/test_adaptive_traces.py) prose ran at 0.970 of the best fixed k with it, 0.987 with half (0.966
and 0.984 with the 1:1 prior). Reported acceptances (``position_acceptance``) are the point estimates. Counts decay by
``decay`` (0.97) per round that measures them: recent rounds weigh more, ~30 rounds' memory.

**Exploration** keeps the arms around the best measured while drafting too, so a one-off outlier is washed out
rather than avoided forever (only the chosen arm is ever timed): every ``explore_every`` (16) decisions of a request
that drafts, it takes a *neighbour* of the best arm - one depth shorter or longer in the same kind, or the other
kind (chain / tree) at the same depth - the one this batch size has gone longest without (ties: the shallower,
chains first). A neighbour is valued close to the best, so a round spent there costs little; exploring every arm,
as this module did before, spends some of those rounds far off (k = 4 on prose, k = 1 on code). An arm further away is
still reached when it pays: the best moves to the neighbour once that measures better, and the next exploration
looks past it; and a plain step's probes visit every drafting arm. The schedule is deterministic (a decision
counter per request, staggered across requests by their order of arrival; no clock, no randomness).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import NamedTuple

from specdec.spec_decode.cost_model import CostModel


class Arm(NamedTuple):
    """What a request drafts in a round: ``depth`` drafts in a chain, or a tree of that depth (0: a plain step)."""

    depth: int
    tree: bool = False


PLAIN = Arm(0)


@dataclass
class _RequestState:
    reached: list[float] = field(default_factory=list)  # [k_max] decayed chain rounds that reached position j + 1
    accepted: list[float] = field(default_factory=list)  # [k_max] ... whose draft there was accepted
    rounds_seen: list[int] = field(default_factory=list)  # [k_max] chain rounds that reached position j + 1, undecayed
    tree_rounds: list[float] = field(default_factory=list)  # [k_max] decayed tree rounds of depth d + 1
    tree_tokens: list[float] = field(default_factory=list)  # [k_max] ... their tokens emitted (accepted + 1)
    steps_off: int = 0
    probe_gap: int = 2  # plain steps before the next probe: doubles per probe that changes nothing, to probe_every
    probes: int = 0
    decisions: int = 0  # choose() calls that could draft (cap >= 1)
    rounds: int = 0  # drafted rounds observed (chains and trees)
    phase: int = 0  # staggers the exploration schedule across requests


class AdaptiveK:
    """Per-request choice of a plain step, a chain of k in [1, k_max] or a tree of depth d in [1, k_max], from
    per-position acceptance, measured tree yields and a cost model, with periodic probes and exploration."""

    def __init__(self, k_max: int, cost_model: CostModel, probe_every: int = 16, decay: float = 0.97,
                 prior_accepted: float = 2.0, prior_rejected: float = 1.0, explore_every: int = 16,
                 prior_weight: float = 2.0, tree_nodes: Callable[[int], int] | None = None,
                 adapt_depth: bool = True, optimism: float = 0.5, min_rounds: int = 8):
        self.k_max = k_max
        self.cost_model = cost_model
        self.probe_every = probe_every
        self.explore_every = explore_every  # 0 = never explore
        self.decay = decay
        self.prior = (prior_accepted, prior_rejected)
        self.prior_weight = prior_weight  # rounds' worth of the prior in each position's / depth's estimate
        self.tree_nodes = tree_nodes  # depth -> drafted nodes of the configured tree (None: chains only)
        self.adapt_depth = adapt_depth  # False: the depth stays at the cap (tree or chain there, never plain)
        self.optimism = optimism  # standard errors added to a position's acceptance when choosing (0 = none)
        self.min_rounds = min_rounds  # decisions of a request that draft before it may turn speculation off
        self._state: dict[int, _RequestState] = {}
        self._requests = 0  # requests seen, for the exploration phase
        self._clock = 0  # decisions made, over all requests
        self._last_chosen: dict[tuple[int, Arm], int] = {}  # (batch size, arm) -> clock when last chosen

    # --- estimates ---------------------------------------------------------------------------------------------
    def alpha(self, seq_id: int) -> float:
        """The request's pooled chain acceptance: accepted / reached drafts over all positions (with the prior)."""
        st = self._state.get(seq_id)
        a, r = self.prior
        if st is None:
            return a / (a + r)
        return (sum(st.accepted) + a) / (sum(st.reached) + a + r)

    def position_acceptance(self, seq_id: int, optimistic: bool = False) -> list[float]:
        """r_j for j = 1..k_max: the probability that draft j is accepted given drafts 1..j-1 were. ``optimistic``:
        plus ``optimism`` standard errors of the estimate, ``sqrt(r (1 - r) / (n_j + prior_weight))`` with n_j the
        rounds that ever reached position j (undecayed), capped at 1 - what choices use (see "Optimism" above)."""
        st = self._state.get(seq_id)
        pooled, w = self.alpha(seq_id), self.prior_weight
        if st is None:
            rates, seen = [pooled] * self.k_max, [0] * self.k_max
        else:
            rates = [(acc + w * pooled) / (reach + w) for acc, reach in zip(st.accepted, st.reached)]
            seen = st.rounds_seen
        if not optimistic or not self.optimism:
            return rates
        return [min(1.0, r + self.optimism * math.sqrt(r * (1.0 - r) / (n + w))) for r, n in zip(rates, seen)]

    def expected_tokens(self, seq_id: int, k: int, optimistic: bool = False) -> float:
        """E(k) = 1 + sum_{i=1..k} prod_{j<=i} r_j: tokens a chain round drafting k emits in expectation
        (``optimistic``: with the optimistic r_j of ``position_acceptance``)."""
        total, survive = 1.0, 1.0
        for r in self.position_acceptance(seq_id, optimistic)[:k]:
            survive *= r
            total += survive
        return total

    def expected_tree_tokens(self, seq_id: int, depth: int) -> float:
        """T(d): tokens a tree round of ``depth`` emits, its measured mean leaning on the chain's E(d)."""
        prior, w = self.expected_tokens(seq_id, depth, optimistic=True), self.prior_weight
        st = self._state.get(seq_id)
        if st is None:
            return prior
        return (st.tree_tokens[depth - 1] + w * prior) / (st.tree_rounds[depth - 1] + w)

    def value(self, seq_id: int, batch_size: int, arm: Arm) -> float:
        """Expected tokens per target-step unit of time of ``arm``."""
        if arm.depth == 0:
            return 1.0
        cm = self.cost_model
        if arm.tree:
            nodes = self.tree_nodes(arm.depth)
            cost = cm.tree_draft_cost(arm.depth, batch_size) + cm.tree_verify_cost(nodes, batch_size)
            return self.expected_tree_tokens(seq_id, arm.depth) / cost
        cost = arm.depth * cm.draft_cost(batch_size) + cm.verify_cost(arm.depth, batch_size)
        return self.expected_tokens(seq_id, arm.depth, optimistic=True) / cost

    def arms(self, k_cap: int, trees: bool) -> list[Arm]:
        """The candidates: a plain step, chains and (``trees``) trees up to ``k_cap`` deep - only at the cap itself
        when the depth does not adapt."""
        depths = range(1, k_cap + 1) if self.adapt_depth else [k_cap]
        out = [PLAIN] if self.adapt_depth else []
        out += [Arm(d) for d in depths]
        if trees and self.tree_nodes is not None:
            out += [Arm(d, True) for d in depths]
        return out

    # --- the decision ----------------------------------------------------------------------------------------
    def best_k(self, seq_id: int, batch_size: int, k_cap: int) -> int:
        """The chain length in [0, k_cap] with the highest expected speedup (0 = a plain step); no exploration."""
        return self._best(seq_id, batch_size, self.arms(min(k_cap, self.k_max), trees=False)).depth

    def _best(self, seq_id: int, batch_size: int, arms: list[Arm]) -> Arm:
        st = self._state.get(seq_id)
        young = st is None or max(st.decisions, st.rounds) < self.min_rounds  # steps or measured rounds
        if young and self._could_pay(batch_size, arms):
            arms = [a for a in arms if a.depth]  # too young to turn off on its few rounds
        return max(arms, key=lambda a: (self.value(seq_id, batch_size, a), -a.depth, -a.tree))  # ties: shallower

    def _could_pay(self, batch_size: int, arms: list[Arm]) -> bool:
        """Some drafting arm beats a plain step if every draft is accepted (d + 1 tokens a round)."""
        cm = self.cost_model
        return any((a.depth + 1) / (a.depth * cm.draft_cost(batch_size) + cm.verify_cost(a.depth, batch_size)) > 1.0
                   for a in arms if a.depth and not a.tree)

    def choose(self, seq_id: int, batch_size: int, k_cap: int) -> int:
        """The chain length to draft this step (0 = a plain step); chains only."""
        return self.choose_arm(seq_id, batch_size, k_cap, trees=False).depth

    def choose_arm(self, seq_id: int, batch_size: int, k_cap: int, trees: bool = True) -> Arm:
        """The arm to draft this step; ``trees``: tree arms are allowed this step (a small enough batch)."""
        k_cap = min(k_cap, self.k_max)
        if k_cap <= 0:
            return PLAIN
        arms = self.arms(k_cap, trees)
        best = self._best(seq_id, batch_size, arms)
        st = self._request(seq_id)
        st.decisions += 1
        self._clock += 1
        arm = best
        drafting = [a for a in arms if a.depth > 0]
        if best.depth == 0:
            st.steps_off += 1
            if st.steps_off >= min(st.probe_gap, self.probe_every):  # probe: draft to re-measure acceptance and costs
                st.steps_off = 0
                st.probe_gap = min(2 * st.probe_gap, self.probe_every)
                st.probes += 1
                if st.probes % 2 == 1:  # the drafting arm the estimates value most
                    arm = self._best(seq_id, batch_size, drafting)
                else:  # the drafting arm gone longest without (ties: the deeper)
                    arm = min(drafting, key=lambda a: (self._last_chosen.get((batch_size, a), -1), -a.depth, a.tree))
        else:
            st.steps_off = 0
            st.probe_gap = 2
            others = [a for a in drafting if a != best and _neighbours(a, best)]
            if self.explore_every and others and (st.decisions + st.phase) % self.explore_every == 0:
                arm = min(others, key=lambda a: (self._last_chosen.get((batch_size, a), -1), a.tree, a.depth))
        if arm.depth:
            self._last_chosen[(batch_size, arm)] = self._clock
        return arm

    # --- what rounds tell ------------------------------------------------------------------------------------
    def observe(self, seq_id: int, drafted: int, accepted: int, tree: bool = False) -> None:
        """A round drafted ``drafted`` tokens (a tree: its depth) and accepted the first ``accepted`` of them. A chain
        round: positions 1..accepted reached and accepted, position accepted + 1 (if drafted) reached and rejected.
        A tree round: ``accepted + 1`` tokens emitted at its depth."""
        if drafted == 0:
            return
        st = self._request(seq_id)
        st.rounds += 1
        if tree:
            d = min(drafted, self.k_max) - 1
            st.tree_rounds[d] = st.tree_rounds[d] * self.decay + 1.0
            st.tree_tokens[d] = st.tree_tokens[d] * self.decay + accepted + 1
            return
        reached = min(accepted + 1, drafted, self.k_max)
        for j in range(reached):  # a position forgets only as it is measured again: a rarely reached one keeps
            st.reached[j] = st.reached[j] * self.decay + 1.0  # what its last rounds said
            st.accepted[j] = st.accepted[j] * self.decay + (j < accepted)
            st.rounds_seen[j] += 1

    def _request(self, seq_id: int) -> _RequestState:
        st = self._state.get(seq_id)
        if st is None:
            zeros = [0.0] * self.k_max
            st = self._state[seq_id] = _RequestState(list(zeros), list(zeros), [0] * self.k_max, list(zeros),
                                                     list(zeros), phase=self._requests % max(self.explore_every, 1))
            self._requests += 1
        return st

    def free(self, seq_id: int) -> None:
        self._state.pop(seq_id, None)


def _neighbours(a: Arm, b: Arm) -> bool:
    """One depth apart in the same kind (chain or tree), or the same depth in the other kind."""
    return (a.tree == b.tree and abs(a.depth - b.depth) == 1) or (a.depth == b.depth and a.tree != b.tree)
