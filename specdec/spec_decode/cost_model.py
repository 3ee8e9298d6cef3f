"""Forward costs for adaptive speculation, relative to one target decode step: c (a draft step), v(k) (a target
forward of k+1 tokens per request), and for token trees the draft time and the window's verification cost.

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

**No clamp.** v(k) may come out below 1: on CPU in float32 a 5-token window's prepacked path measured cheaper per
call than a one-token decode (0.6-0.8 of it on the Qwen pair); clamping it to 1 undervalued every chain there.

**Trees.** A tree window's forward (a tree mask, ragged: no CUDA graph) is timed under keys of its own
(``observe_target(..., tree=True)``) and so is a tree round's whole drafting (``observe_tree_draft``: a draft model
forwards one depth at a time over the frontier and reads the host at each depth). Until a depth is measured the
chain's costs stand in: ``depth * c`` and v at the same window size.

The timings are taken by :class:`~specdec.spec_decode.forward_timer.ForwardTimer`, only while adaptive choices are on,
and never with a host sync: perf counters on CPU; on CUDA a pair of CUDA events around each forward, whose elapsed
time is read once both have completed (after the step's one host read has waited for the device anyway).
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

    def tree_draft_cost(self, depth: int, batch_size: int) -> float:
        """A tree round's whole drafting (``depth`` levels), relative to one target decode step."""
        ...

    def tree_verify_cost(self, nodes: int, batch_size: int) -> float:
        """A tree window of ``nodes`` drafted nodes (+ its root) per request, relative to 1 token per request."""
        ...

    def observe_target(self, batch_size: int, num_tokens: int, seconds: float, tree: bool = False) -> None: ...

    def observe_draft(self, batch_size: int, seconds: float) -> None: ...

    def observe_tree_draft(self, batch_size: int, depth: int, seconds: float) -> None: ...


@dataclass
class FixedCostModel:
    """Injected costs: ``c`` and ``v(k) = 1 + verify_slope * k``; a tree of depth d drafts in ``d * c *
    tree_draft_factor`` and verifies n nodes in ``1 + verify_slope * n * tree_verify_factor``. Observations are
    ignored."""

    c: float = 0.0
    verify_slope: float = 0.0
    tree_draft_factor: float = 1.0
    tree_verify_factor: float = 1.0

    def draft_cost(self, batch_size: int) -> float:
        return self.c

    def verify_cost(self, k: int, batch_size: int) -> float:
        return 1.0 + self.verify_slope * k

    def tree_draft_cost(self, depth: int, batch_size: int) -> float:
        return depth * self.c * self.tree_draft_factor

    def tree_verify_cost(self, nodes: int, batch_size: int) -> float:
        return 1.0 + self.verify_slope * nodes * self.tree_verify_factor

    def observe_target(self, batch_size: int, num_tokens: int, seconds: float, tree: bool = False) -> None:
        pass

    def observe_draft(self, batch_size: int, seconds: float) -> None:
        pass

    def observe_tree_draft(self, batch_size: int, depth: int, seconds: float) -> None:
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
    _tree_target: dict[int, dict[int, _Samples]] = field(default_factory=dict)  # ... tree windows' forwards
    _tree_draft: dict[tuple[int, int], _Samples] = field(default_factory=dict)  # (batch, depth) -> drafting

    def _add(self, samples: _Samples | None, seconds: float) -> _Samples:
        if samples is None:  # warm-up sample: a first call may include a JIT compile / autotune / warm-up
            return _Samples(seconds, deque(maxlen=self.window))
        samples.recent.append(seconds)
        return samples

    def observe_target(self, batch_size: int, num_tokens: int, seconds: float, tree: bool = False) -> None:
        points = (self._tree_target if tree else self._target).setdefault(batch_size, {})
        points[num_tokens] = self._add(points.get(num_tokens), seconds)

    def observe_tree_draft(self, batch_size: int, depth: int, seconds: float) -> None:
        key = (batch_size, depth)
        self._tree_draft[key] = self._add(self._tree_draft.get(key), seconds)

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
            return many / one  # below 1 where a window's path is cheaper per call than a decode's (CPU fp32)
        return 1.0 + self.prior_slope * k

    def tree_draft_cost(self, depth: int, batch_size: int) -> float:
        """Measured drafting of a tree of ``depth`` over the decode time (lower median; warm-up rule), else
        ``depth * c``. Model-free proposers: 0."""
        if self.is_model_free:
            return 0.0
        samples = self._tree_draft.get((batch_size, depth))
        one = self._target_time(batch_size, batch_size)
        if samples is None or not one:
            return depth * self.draft_cost(batch_size)
        return (median_low(samples.recent) if samples.recent else samples.warmup) / one

    def tree_verify_cost(self, nodes: int, batch_size: int) -> float:
        """A tree window's measured forward over the decode time (its own samples: median from ``min_samples``, else
        the cheapest), else the chain's v at the same window size."""
        samples = self._tree_target.get(batch_size, {}).get(batch_size * (nodes + 1))
        one = self._target_time(batch_size, batch_size)
        if samples is None or not one:
            return self.verify_cost(nodes, batch_size)
        mine = median_low(samples.recent) if len(samples.recent) >= self.min_samples else min(
            [samples.warmup, *samples.recent])
        return mine / one


def expected_speedup(alpha: float, k: int, c: float, v: float) -> float:
    """Expected tokens per target-step unit of time: ``sum_{i=0..k} alpha^i / (k*c + v)``."""
    return sum(alpha**i for i in range(k + 1)) / (k * c + v)
