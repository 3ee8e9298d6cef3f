"""Adaptive speculation length: per request, choose the k that maximises expected tokens per unit of time.

Drafting k tokens yields ``E(k) = 1 + sum_{i=1..k} prod_{j<=i} r_j`` tokens in expectation, where r_j is the
probability that draft j is accepted given drafts 1..j-1 were (Leviathan et al., eq. 1 is the case r_j = alpha
for every j), and costs ``k*c + v(k)`` target-step units, where c is one draft step relative to one target decode
step (~0 for model-free drafters) and v(k) the target's cost for k+1 tokens per request relative to 1 token
(v(0) = 1). The chosen k maximises ``E(k) / (k c + v(k))`` (k = 0: a plain step, value 1).

**Acceptance per position.** Every verified round tells, for each position it reached, whether the draft there
was accepted: a round that drafted d tokens and accepted a reached positions 1..min(a + 1, d). Each request keeps
decayed counts per position (reached, accepted), so r_j is known at every position any round has reached, also
from rounds that drafted fewer than k tokens; a position with little data leans on the request's pooled
acceptance (all positions together; 0.5 before anything is known) with the weight of ``prior_weight`` rounds.
Prompts with a structured prefix and a free tail (acceptance 1.0 at position 1, 0.2 at position 4) are then
priced per position instead of by one average.

**From any start.** k = 0 switches speculation off for the request; every ``probe_every`` plain steps it drafts
once to re-measure. A probe drafts the k >= 1 the estimates value most - or, every other probe, the k >= 1 this
batch size has gone longest without (ties: the larger k, which times a draft step and reaches more positions) - so
the costs and acceptances of every k get measured again. An engine that found short windows slow (on CPU a 2- or
3-row float32 GEMM can cost as much as a 5-row one or more) therefore still finds a long k that pays: probing only
k = 1 - what this module did before - could never climb out of k = 0 there.

Measured costs are robust to outliers (a first-call JIT compile or autotune, a noisy neighbour):

- **Warm-up rule.** The first observation of every (batch size, token count) target key and of every draft batch
  size is a warm-up sample and is discarded: a first call may include a JIT compile, an autotune or allocator
  warm-up. It stands in only while its batch size has no other data at all (the target: no key of that batch size
  has a sample past its warm-up; the draft: no second sample), so that a cost model that has seen each shape once
  still answers from data; the first real sample replaces it. (It can still lower its own key's estimate below the
  line: see the line fit.)
- **Median window.** Each key keeps its last ``window`` (8) samples and is valued at their lower median (timing
  noise only ever adds time), so a single outlier among three or more samples does not move the estimate.
- **Line fit.** v(k) comes from the target time at B*(k+1) tokens: a key's own median once it holds
  ``min_samples`` (3) samples, otherwise a least-squares line through the medians of the keys that do (through all
  keys while fewer than two do), lowered to the key's own cheapest sample if it has any (its warm-up one included):
  a key measured once or twice - perhaps an outlier - cannot veto its k, and a cheap first measurement is believed
  at once (noise only adds time; and forward costs need not lie on a line).

Exploration keeps every k measured while drafting too, so a one-off outlier is washed out rather than avoided
forever (only the chosen k is ever timed): every ``explore_every`` (16) decisions of a request that drafts (best
k >= 1, cap >= 2),
it drafts the k in [1, cap] other than the best that this batch size has gone longest without (ties: the smaller
k). The schedule is deterministic (a decision counter per request, staggered across requests by their order of
arrival; no clock, no randomness). Its overhead is 1 round in 16 drafted at a k one step or more off the best;
with all drafts accepted and near-flat verify costs (the simulation in tests/test_adaptive.py) that is under
2% of throughput.

The timings are taken by :class:`ForwardTimer`, only while adaptive k is on, and never with a host sync: perf
counters on CPU; on CUDA a pair of CUDA events around each forward, whose elapsed time is read once both have
completed (after the step's one host read has waited for the device anyway).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from statistics import median_low
from typing import Protocol


class CostModel(Protocol):
    def draft_cost(self, batch_size: int) -> float:
        """c: one draft step for ``batch_size`` requests, relative to one target decode step."""
        ...

    def verify_cost(self, k: int, batch_size: int) -> float:
        """v(k): a target forward of k+1 tokens per request, relative to 1 token per request (v(0) = 1)."""
        ...

    def observe_target(self, batch_size: int, num_tokens: int, seconds: float) -> None: ...

    def observe_draft(self, batch_size: int, seconds: float) -> None: ...


@dataclass
class FixedCostModel:
    """Injected costs: ``c`` and ``v(k) = 1 + verify_slope * k``. Observations are ignored."""

    c: float = 0.0
    verify_slope: float = 0.0

    def draft_cost(self, batch_size: int) -> float:
        return self.c

    def verify_cost(self, k: int, batch_size: int) -> float:
        return 1.0 + self.verify_slope * k

    def observe_target(self, batch_size: int, num_tokens: int, seconds: float) -> None:
        pass

    def observe_draft(self, batch_size: int, seconds: float) -> None:
        pass


@dataclass
class _Samples:
    """One key's timings: the warm-up sample (discarded) and a window of the recent ones after it."""

    warmup: float
    recent: deque = field(default_factory=deque)


def _line(points: dict[int, float], x: float) -> float:
    """Least-squares line through ``points`` (>= 2 distinct x), evaluated at x (kept positive)."""
    xs = sorted(points)
    mean_x = sum(xs) / len(xs)
    mean_y = sum(points[p] for p in xs) / len(xs)
    slope = sum((p - mean_x) * (points[p] - mean_y) for p in xs) / sum((p - mean_x) ** 2 for p in xs)
    return max(mean_y + slope * (x - mean_x), 1e-9)


@dataclass
class MeasuredCostModel:
    """Costs from the engine's own forward timings: per batch size, a median window per token count.

    See the module docstring for the warm-up rule, the median window and the line fit over token counts (v(k) is
    known before every k has been tried). Until there is data, ``prior_c`` and ``prior_slope`` stand in.
    """

    is_model_free: bool = False
    prior_c: float = 0.3
    prior_slope: float = 0.1
    window: int = 8  # recent samples kept per key
    min_samples: int = 3  # a key answers for itself from this many samples; before, the fitted line does
    _target: dict[int, dict[int, _Samples]] = field(default_factory=dict)  # batch size -> tokens -> samples
    _draft: dict[int, _Samples] = field(default_factory=dict)  # batch size -> seconds per draft step

    def _add(self, samples: _Samples | None, seconds: float) -> _Samples:
        if samples is None:  # warm-up sample: a first call may include a JIT compile / autotune / warm-up
            return _Samples(seconds, deque(maxlen=self.window))
        samples.recent.append(seconds)
        return samples

    def observe_target(self, batch_size: int, num_tokens: int, seconds: float) -> None:
        points = self._target.setdefault(batch_size, {})
        points[num_tokens] = self._add(points.get(num_tokens), seconds)

    def observe_draft(self, batch_size: int, seconds: float) -> None:
        self._draft[batch_size] = self._add(self._draft.get(batch_size), seconds)

    def _points(self, batch_size: int) -> dict[int, tuple[float, int]]:
        """token count -> (lower median, samples) past warm-up; the warm-up samples while there are none."""
        keys = self._target.get(batch_size, {})
        points = {n: (median_low(s.recent), len(s.recent)) for n, s in keys.items() if s.recent}
        return points or {n: (s.warmup, 1) for n, s in keys.items()}

    def _target_time(self, batch_size: int, num_tokens: int) -> float | None:
        points = self._points(batch_size)
        if not points:
            return None
        solid = {n: t for n, (t, count) in points.items() if count >= self.min_samples}
        if num_tokens in solid:
            return solid[num_tokens]
        line = None
        if len(solid) >= 2:
            line = _line(solid, num_tokens)
        elif len(points) >= 2:
            line = _line({n: t for n, (t, _) in points.items()}, num_tokens)
        # A key's own few samples (its warm-up one included) can only lower the line: timing noise only ever adds
        # time, so a cheap measurement is real while an expensive one may be an outlier. (Forward costs need not
        # lie on a line: on CPU a 2-row float32 GEMM without a packed weight costs more than a 5-row one with it.)
        keys = self._target.get(batch_size, {})
        own = keys.get(num_tokens)
        if own is not None:
            mine = min([own.warmup, *own.recent])
            return mine if line is None else min(mine, line)
        return line

    def _draft_time(self, batch_size: int) -> float | None:
        samples = self._draft.get(batch_size)
        if samples is None:
            return None
        return median_low(samples.recent) if samples.recent else samples.warmup

    def draft_cost(self, batch_size: int) -> float:
        if self.is_model_free:
            return 0.0
        one = self._target_time(batch_size, batch_size)
        draft = self._draft_time(batch_size)
        return draft / one if draft is not None and one else self.prior_c

    def verify_cost(self, k: int, batch_size: int) -> float:
        if k == 0:
            return 1.0
        one = self._target_time(batch_size, batch_size)
        many = self._target_time(batch_size, batch_size * (k + 1))
        if one and many:
            return max(many / one, 1.0)
        return 1.0 + self.prior_slope * k


def expected_speedup(alpha: float, k: int, c: float, v: float) -> float:
    """Expected tokens per target-step unit of time: ``sum_{i=0..k} alpha^i / (k*c + v)``."""
    return sum(alpha**i for i in range(k + 1)) / (k * c + v)


@dataclass
class _RequestState:
    reached: list[float] = field(default_factory=list)  # [k_max] decayed rounds that reached position j + 1
    accepted: list[float] = field(default_factory=list)  # [k_max] ... whose draft there was accepted
    steps_off: int = 0
    probes: int = 0
    decisions: int = 0  # choose() calls that could draft (cap >= 1)
    phase: int = 0  # staggers the exploration schedule across requests


class AdaptiveK:
    """Per-request choice of k in [0, k_max] from per-position acceptance and a cost model, with periodic probes
    and exploration (module docstring)."""

    def __init__(self, k_max: int, cost_model: CostModel, probe_every: int = 16, decay: float = 0.9,
                 prior_accepted: float = 1.0, prior_rejected: float = 1.0, explore_every: int = 16,
                 prior_weight: float = 2.0):
        self.k_max = k_max
        self.cost_model = cost_model
        self.probe_every = probe_every
        self.explore_every = explore_every  # 0 = never explore
        self.decay = decay
        self.prior = (prior_accepted, prior_rejected)
        self.prior_weight = prior_weight  # rounds' worth of the pooled acceptance in each position's estimate
        self._state: dict[int, _RequestState] = {}
        self._requests = 0  # requests seen, for the exploration phase
        self._clock = 0  # decisions made, over all requests
        self._last_chosen: dict[tuple[int, int], int] = {}  # (batch size, k) -> clock when last chosen

    def alpha(self, seq_id: int) -> float:
        """The request's pooled acceptance: accepted drafts / drafts reached, over all positions (with the prior)."""
        st = self._state.get(seq_id)
        a, r = self.prior
        if st is None:
            return a / (a + r)
        accepted, reached = sum(st.accepted), sum(st.reached)
        return (accepted + a) / (reached + a + r)

    def position_acceptance(self, seq_id: int) -> list[float]:
        """r_j for j = 1..k_max: the probability that draft j is accepted given drafts 1..j-1 were."""
        st = self._state.get(seq_id)
        pooled, w = self.alpha(seq_id), self.prior_weight
        if st is None:
            return [pooled] * self.k_max
        return [(acc + w * pooled) / (reach + w) for acc, reach in zip(st.accepted, st.reached)]

    def expected_tokens(self, seq_id: int, k: int) -> float:
        """E(k) = 1 + sum_{i=1..k} prod_{j<=i} r_j: tokens a round drafting k emits in expectation."""
        total, survive = 1.0, 1.0
        for r in self.position_acceptance(seq_id)[:k]:
            survive *= r
            total += survive
        return total

    def _request(self, seq_id: int) -> _RequestState:
        st = self._state.get(seq_id)
        if st is None:
            st = self._state[seq_id] = _RequestState([0.0] * self.k_max, [0.0] * self.k_max,
                                                     phase=self._requests % max(self.explore_every, 1))
            self._requests += 1
        return st

    def values(self, seq_id: int, batch_size: int, k_cap: int) -> list[float]:
        """Expected tokens per target-step unit for k = 0..min(k_cap, k_max): ``E(k) / (k c + v(k))``."""
        c = self.cost_model.draft_cost(batch_size)
        return [1.0] + [self.expected_tokens(seq_id, k) / (k * c + self.cost_model.verify_cost(k, batch_size))
                        for k in range(1, min(k_cap, self.k_max) + 1)]

    def best_k(self, seq_id: int, batch_size: int, k_cap: int) -> int:
        """The k in [0, k_cap] with the highest expected speedup (0 = a plain step); no exploration."""
        values = self.values(seq_id, batch_size, k_cap)
        return max(range(len(values)), key=lambda k: (values[k], -k))  # ties: the smaller k

    def choose(self, seq_id: int, batch_size: int, k_cap: int) -> int:
        """The k to draft this step (0 = a plain step)."""
        k_cap = min(k_cap, self.k_max)
        if k_cap <= 0:
            return 0
        values = self.values(seq_id, batch_size, k_cap)
        best_k = max(range(len(values)), key=lambda k: (values[k], -k))
        st = self._request(seq_id)
        st.decisions += 1
        self._clock += 1
        k = best_k
        if best_k == 0:
            st.steps_off += 1
            if st.steps_off >= self.probe_every:  # probe: draft to re-measure acceptance and costs
                st.steps_off = 0
                st.probes += 1
                if st.probes % 2 == 1:  # the k >= 1 the estimates value most
                    k = max(range(1, k_cap + 1), key=lambda j: (values[j], -j))
                else:  # the k >= 1 gone longest without (ties: the larger)
                    k = min(range(1, k_cap + 1), key=lambda j: (self._last_chosen.get((batch_size, j), -1), -j))
        else:
            st.steps_off = 0
            if self.explore_every and k_cap >= 2 and (st.decisions + st.phase) % self.explore_every == 0:
                k = min((j for j in range(1, k_cap + 1) if j != best_k),
                        key=lambda j: (self._last_chosen.get((batch_size, j), -1), j))
        if k:
            self._last_chosen[(batch_size, k)] = self._clock
        return k

    def observe(self, seq_id: int, drafted: int, accepted: int) -> None:
        """A round drafted ``drafted`` tokens and accepted the first ``accepted`` of them: positions 1..accepted were
        reached and accepted, position accepted + 1 (if drafted) reached and rejected."""
        if drafted == 0:
            return
        st = self._request(seq_id)
        reached = min(accepted + 1, drafted, self.k_max)
        for j in range(reached):  # a position forgets only as it is measured again: a rarely reached one keeps
            st.reached[j] = st.reached[j] * self.decay + 1.0  # what its last rounds said
            st.accepted[j] = st.accepted[j] * self.decay + (j < accepted)

    def free(self, seq_id: int) -> None:
        self._state.pop(seq_id, None)
