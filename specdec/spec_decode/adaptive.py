"""Adaptive speculation length: per request, choose the k that maximises expected tokens per unit of time.

With alpha the per-token acceptance probability (estimated online per request), drafting k tokens yields
``sum_{i=0..k} alpha^i`` tokens in expectation (Leviathan et al., eq. 1) and costs ``k*c + v(k)`` target-step
units, where c is one draft step relative to one target decode step (~0 for model-free drafters) and v(k) the
target's cost for k+1 tokens per request relative to 1 token (v(0) = 1). Both are measured per batch size (a batch
drafts max(k_i) steps and verifies sum(k_i + 1) tokens), or injected - tests use fixed costs and never time
anything. k = 0 switches speculation off for the request; every ``probe_every`` plain steps it drafts once with
k = 1 to re-estimate alpha and come back when drafting pays again (every 4th probe drafts k = 2 instead when the
draft has a cost, so that a draft step gets timed again: a k = 1 round times none).

Measured costs are robust to outliers (a first-call JIT compile or autotune, a noisy neighbour):

- **Warm-up rule.** The first observation of every (batch size, token count) target key and of every draft batch
  size is a warm-up sample and is discarded: a first call may include a JIT compile, an autotune or allocator
  warm-up. It stands in only while its batch size has no other data at all (the target: no key of that batch size
  has a sample past its warm-up; the draft: no second sample), so that a cost model that has seen each shape once
  still answers from data; the first real sample replaces it.
- **Median window.** Each key keeps its last ``window`` (8) samples and is valued at their lower median (timing
  noise only ever adds time), so a single outlier among three or more samples does not move the estimate.
- **Line fit.** v(k) comes from the target time at B*(k+1) tokens: a key's own median once it holds
  ``min_samples`` (3) samples, otherwise a least-squares line through the medians of the keys that do (through all
  keys while fewer than two do), so a key measured once or twice - perhaps an outlier - cannot veto its k.

Exploration keeps every k measured, so a one-off outlier is washed out rather than avoided forever (only the
chosen k is ever timed): every ``explore_every`` (16) decisions of a request that drafts (best k >= 1, cap >= 2),
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
        if len(solid) >= 2:
            return _line(solid, num_tokens)
        if num_tokens in points:
            return points[num_tokens][0]
        if len(points) >= 2:
            return _line({n: t for n, (t, _) in points.items()}, num_tokens)
        return None

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
    accepted: float = 0.0
    rejected: float = 0.0
    steps_off: int = 0
    probes: int = 0
    decisions: int = 0  # choose() calls that could draft (cap >= 1)
    phase: int = 0  # staggers the exploration schedule across requests


class AdaptiveK:
    """Per-request choice of k in [0, k_max] from an online alpha and a cost model, with periodic exploration."""

    def __init__(self, k_max: int, cost_model: CostModel, probe_every: int = 16, decay: float = 0.9,
                 prior_accepted: float = 1.0, prior_rejected: float = 1.0, explore_every: int = 16):
        self.k_max = k_max
        self.cost_model = cost_model
        self.probe_every = probe_every
        self.explore_every = explore_every  # 0 = never explore
        self.decay = decay
        self.prior = (prior_accepted, prior_rejected)
        self._state: dict[int, _RequestState] = {}
        self._requests = 0  # requests seen, for the exploration phase
        self._clock = 0  # decisions made, over all requests
        self._last_chosen: dict[tuple[int, int], int] = {}  # (batch size, k) -> clock when last chosen

    def alpha(self, seq_id: int) -> float:
        st = self._state.get(seq_id, _RequestState())
        a, r = self.prior
        return (st.accepted + a) / (st.accepted + st.rejected + a + r)

    def _request(self, seq_id: int) -> _RequestState:
        st = self._state.get(seq_id)
        if st is None:
            st = self._state[seq_id] = _RequestState(phase=self._requests % max(self.explore_every, 1))
            self._requests += 1
        return st

    def best_k(self, seq_id: int, batch_size: int, k_cap: int) -> int:
        """The k in [0, k_cap] with the highest expected speedup (0 = a plain step); no exploration."""
        alpha = self.alpha(seq_id)
        c = self.cost_model.draft_cost(batch_size)
        best_k, best = 0, 1.0  # k = 0: one token per target step
        for k in range(1, min(k_cap, self.k_max) + 1):
            value = expected_speedup(alpha, k, c, self.cost_model.verify_cost(k, batch_size))
            if value > best:
                best_k, best = k, value
        return best_k

    def choose(self, seq_id: int, batch_size: int, k_cap: int) -> int:
        """The k to draft this step (0 = a plain step)."""
        k_cap = min(k_cap, self.k_max)
        if k_cap <= 0:
            return 0
        best_k = self.best_k(seq_id, batch_size, k_cap)
        st = self._request(seq_id)
        st.decisions += 1
        self._clock += 1
        k = best_k
        if best_k == 0:
            st.steps_off += 1
            if st.steps_off >= self.probe_every:  # probe: draft to re-estimate alpha
                st.steps_off = 0
                st.probes += 1
                # every 4th probe drafts 2 when drafting costs something: only steps after the first are timed
                timed = st.probes % 4 == 0 and k_cap >= 2 and self.cost_model.draft_cost(batch_size) > 0
                k = 2 if timed else 1
        else:
            st.steps_off = 0
            if self.explore_every and k_cap >= 2 and (st.decisions + st.phase) % self.explore_every == 0:
                k = min((j for j in range(1, k_cap + 1) if j != best_k),
                        key=lambda j: (self._last_chosen.get((batch_size, j), -1), j))
        if k:
            self._last_chosen[(batch_size, k)] = self._clock
        return k

    def observe(self, seq_id: int, drafted: int, accepted: int) -> None:
        """A round drafted ``drafted`` tokens and accepted the first ``accepted`` of them."""
        if drafted == 0:
            return
        st = self._request(seq_id)
        st.accepted = st.accepted * self.decay + accepted
        st.rejected = st.rejected * self.decay + (accepted < drafted)

    def free(self, seq_id: int) -> None:
        self._state.pop(seq_id, None)
