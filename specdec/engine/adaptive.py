"""Adaptive speculation length: per request, choose the k that maximises expected tokens per unit of time.

With alpha the per-token acceptance probability (estimated online per request), drafting k tokens yields
``sum_{i=0..k} alpha^i`` tokens in expectation (Leviathan et al., eq. 1) and costs ``k*c + v(k)`` target-step
units, where c is one draft step relative to one target decode step (~0 for model-free drafters) and v(k) the
target's cost for k+1 tokens per request relative to 1 token (v(0) = 1). Both are measured per batch size (a batch
drafts max(k_i) steps and verifies sum(k_i + 1) tokens), or injected - tests use fixed costs and never time
anything. k = 0 switches speculation off for the request; every ``probe_every`` plain steps it drafts once with
k = 1 to re-estimate alpha and come back when drafting pays again.
"""

from __future__ import annotations

from dataclasses import dataclass, field
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
class MeasuredCostModel:
    """Costs from the engine's own forward timings (exponential moving averages per batch size).

    The target's time for ``n`` tokens at batch size B is fitted as a line through the measured points, so v(k)
    is known before every k has been tried. Until there is data, ``prior_c`` and ``prior_slope`` stand in.
    """

    is_model_free: bool = False
    prior_c: float = 0.3
    prior_slope: float = 0.1
    smoothing: float = 0.2
    _target: dict[int, dict[int, float]] = field(default_factory=dict)  # batch size -> tokens -> seconds
    _draft: dict[int, float] = field(default_factory=dict)  # batch size -> seconds per draft step

    def observe_target(self, batch_size: int, num_tokens: int, seconds: float) -> None:
        points = self._target.setdefault(batch_size, {})
        old = points.get(num_tokens)
        points[num_tokens] = seconds if old is None else old + self.smoothing * (seconds - old)

    def observe_draft(self, batch_size: int, seconds: float) -> None:
        old = self._draft.get(batch_size)
        self._draft[batch_size] = seconds if old is None else old + self.smoothing * (seconds - old)

    def _target_time(self, batch_size: int, num_tokens: int) -> float | None:
        points = self._target.get(batch_size)
        if not points:
            return None
        if num_tokens in points:
            return points[num_tokens]
        if len(points) == 1:
            return None
        xs = sorted(points)
        mean_x = sum(xs) / len(xs)
        mean_y = sum(points[x] for x in xs) / len(xs)
        slope = sum((x - mean_x) * (points[x] - mean_y) for x in xs) / sum((x - mean_x) ** 2 for x in xs)
        return max(mean_y + slope * (num_tokens - mean_x), 1e-9)

    def draft_cost(self, batch_size: int) -> float:
        if self.is_model_free:
            return 0.0
        one = self._target_time(batch_size, batch_size)
        draft = self._draft.get(batch_size)
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


class AdaptiveK:
    """Per-request choice of k in [0, k_max] from an online alpha and a cost model."""

    def __init__(self, k_max: int, cost_model: CostModel, probe_every: int = 16, decay: float = 0.9,
                 prior_accepted: float = 1.0, prior_rejected: float = 1.0):
        self.k_max = k_max
        self.cost_model = cost_model
        self.probe_every = probe_every
        self.decay = decay
        self.prior = (prior_accepted, prior_rejected)
        self._state: dict[int, _RequestState] = {}

    def alpha(self, seq_id: int) -> float:
        st = self._state.get(seq_id, _RequestState())
        a, r = self.prior
        return (st.accepted + a) / (st.accepted + st.rejected + a + r)

    def choose(self, seq_id: int, batch_size: int, k_cap: int) -> int:
        """The k to draft this step (0 = a plain step)."""
        k_cap = min(k_cap, self.k_max)
        if k_cap <= 0:
            return 0
        alpha = self.alpha(seq_id)
        c = self.cost_model.draft_cost(batch_size)
        best_k, best = 0, 1.0  # k = 0: one token per target step
        for k in range(1, k_cap + 1):
            value = expected_speedup(alpha, k, c, self.cost_model.verify_cost(k, batch_size))
            if value > best:
                best_k, best = k, value
        st = self._state.setdefault(seq_id, _RequestState())
        if best_k == 0:
            st.steps_off += 1
            if st.steps_off >= self.probe_every:  # probe: draft one token to re-estimate alpha
                st.steps_off = 0
                return 1
        else:
            st.steps_off = 0
        return best_k

    def observe(self, seq_id: int, drafted: int, accepted: int) -> None:
        """A round drafted ``drafted`` tokens and accepted the first ``accepted`` of them."""
        if drafted == 0:
            return
        st = self._state.setdefault(seq_id, _RequestState())
        st.accepted = st.accepted * self.decay + accepted
        st.rejected = st.rejected * self.decay + (accepted < drafted)

    def free(self, seq_id: int) -> None:
        self._state.pop(seq_id, None)
