"""SpeculationPolicy: how much each request drafts - the lookahead the scheduler reserves, the depth and shape
(chain or tree) of its round - and what the policy learns from every round (adaptive k: acceptance estimates and
measured forward costs).

The policy never drafts and never verifies; ``Speculator.draft`` asks it for each round's plan, the engine's commit
tells it each verified round's outcome (``observe_round``), and the step's target forward is timed through
:meth:`SpeculationPolicy.timing` (a context manager; nothing is timed when adaptive choices are off).
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from specdec.config import EngineConfig, SpeculativeConfig
from specdec.runner.model_runner import ModelRunner
from specdec.spec_decode.adaptive import PLAIN, AdaptiveK, Arm
from specdec.spec_decode.calibration import calibrate
from specdec.spec_decode.cost_model import MeasuredCostModel
from specdec.spec_decode.forward_timer import ForwardTimer
from specdec.spec_decode.request import RequestView


@dataclass
class RoundPlan:
    """What the requests of one round draft (those granted a lookahead > 0, in batch order)."""

    requests: list[RequestView]
    depths: list[int]  # per request: a chain's length, or its tree's depth cap
    budgets: list[int]  # per request: the slots granted (a tree's node budget)
    trees: bool  # tree round (every request drafts a tree) or chain round


class SpeculationPolicy:
    """Per request and step: the lookahead to reserve, then the round's depths and shape.

    Args:
        config: the engine's (``max_model_len``).
        spec_config: the speculative settings (k, trees, adaptive choices, an injected ``cost_model``).
    ``max_positions`` (the proposer's position limit) is set by the owner once the proposer is built.
    """

    def __init__(self, config: EngineConfig, spec_config: SpeculativeConfig):
        self.spec_config = spec_config
        self.max_model_len = config.max_model_len
        self.k_max = spec_config.num_speculative_tokens  # the longest chain (a tree's deepest path)
        self.max_positions = config.max_model_len  # the proposer's limit, when it has one (set by the owner)
        self.cost_model = spec_config.cost_model or MeasuredCostModel(is_model_free=not spec_config.drafts_with_a_model)
        # adaptive choices: the chain length (adaptive=True) and/or tree or chain per round (tree_policy "measured")
        self.adaptive = self._new_adaptive() if spec_config.adaptive or spec_config.measures_trees else None
        self.timer = ForwardTimer() if self.adaptive is not None else None  # forwards are timed for those only
        self.batch_size = 1  # running requests, refreshed every step (adaptive k is chosen per batch size)
        self._arms: dict[int, Arm] = {}  # seq id -> the arm chosen at its last lookahead (adaptive choices only)
        self._runners: tuple[ModelRunner, ModelRunner | None] | None = None  # (target, draft), once calibrated

    @property
    def max_tree_nodes(self) -> int:
        """The most drafted nodes a round reserves slots for (a chain: k_max)."""
        return self.spec_config.tree_nodes(self.k_max)

    # --- the scheduler asks before every step ------------------------------------------------------------------
    def lookahead(self, request: RequestView) -> int:
        """Slots to reserve beyond the last token: the chain length k_eff = min(k_max, max_model_len - kv_len - 1,
        max_tokens_left - 1, draft positions - kv_len - 1); with adaptive choices the arm's (a chain's length, a
        tree's drafted nodes, at the depth chosen); with ``tree_policy="always"`` (while the batch is small enough
        for trees) the tree's drafted nodes at depth k_eff."""
        k_cap = self._k_cap(request)
        if k_cap <= 0:
            return 0
        if self.adaptive is not None:
            trees = self._trees_now(self.batch_size)
            arm = self.adaptive.choose_arm(request.seq_id, self.batch_size, k_cap, trees=trees)
            self._arms[request.seq_id] = arm
            return self.spec_config.tree_nodes(arm.depth) if arm.tree else arm.depth
        if self._trees_now(self.batch_size):
            return self.spec_config.tree_nodes(k_cap)
        return k_cap

    def plan(self, requests: list[RequestView], lookaheads: list[int], batch_size: int) -> RoundPlan:
        """The round of ``requests`` (the batch's decode steps) given the lookahead each was granted;
        ``batch_size``: the step's requests in all (trees are drafted only while it is small enough). A request
        that chose a tree drafts the chain of the tree's depth in a chain round (its slots hold it)."""
        speculating = [r for r, n in zip(requests, lookaheads) if n > 0]
        budgets = [n for n in lookaheads if n > 0]
        trees = bool(speculating) and self._tree_round(speculating, batch_size)
        depths = [self._depth(r, n) for r, n in zip(speculating, budgets)]
        if trees:
            depths = [min(self._k_cap(r), d) for r, d in zip(speculating, depths)]
        return RoundPlan(speculating, depths, budgets, trees)

    def _k_cap(self, request: RequestView) -> int:
        kv_len = request.num_tokens - 1  # the last token's K/V is written by this step's forward
        left = request.params.max_tokens - len(request.output_token_ids)
        return min(self.k_max, self.max_model_len - kv_len - 1, left - 1, self.max_positions - kv_len - 1)

    def _trees_now(self, batch_size: int) -> bool:
        return self.spec_config.uses_tree and batch_size <= self.spec_config.tree_max_batch_size

    def _tree_round(self, speculating: list[RequestView], batch_size: int) -> bool:
        """Trees this round: the batch is small enough and (measured policy) every drafting request chose one."""
        if not self._trees_now(batch_size):
            return False
        if not self.spec_config.measures_trees:
            return True
        return all(self._arms.get(r.seq_id, PLAIN).tree for r in speculating)

    def _depth(self, request: RequestView, granted: int) -> int:
        """The depth a request drafts to: its arm's (within the slots granted), else the slots granted."""
        arm = self._arms.get(request.seq_id)
        return min(arm.depth, granted) if arm is not None and arm.depth else granted

    # --- what the policy learns ------------------------------------------------------------------------------
    def observe_round(self, seq_id: int, drafted: int, accepted: int, tree: bool = False) -> None:
        """A committed round of ``drafted`` drafts (a tree: its depth), ``accepted`` of them accepted."""
        if self.adaptive is not None:
            self.adaptive.observe(seq_id, drafted, accepted, tree)

    def observe_draft(self, batch_size: int, seconds: float) -> None:
        """One pure draft step of ``batch_size`` requests took ``seconds`` (the proposer's timed forwards)."""
        self.cost_model.observe_draft(batch_size, seconds)

    def free(self, seq_id: int, finished: bool) -> None:
        """The request left the running batch (``finished``: for good; else preempted)."""
        self._arms.pop(seq_id, None)
        if self.adaptive is not None and finished:
            self.adaptive.free(seq_id)

    @contextlib.contextmanager
    def timing(self, device: torch.device, enabled: bool = True) -> Iterator[StepTiming | None]:
        """The step's timings: yields a :class:`StepTiming` (None when adaptive choices are off or ``enabled`` is
        False: then nothing is timed, the proposer's draft steps neither - a retried half of a failed step is not
        the batch size the costs are kept for); on a normal exit - after the step's host read - the timings that
        have completed go to the cost model (no sync; a step that raised leaves them to the next flush)."""
        if self.timer is None:
            yield None
            return
        if not enabled:
            self.timer.paused = True
            try:
                yield None
            finally:
                self.timer.paused = False
            return
        yield StepTiming(self, device)
        self.timer.flush()

    # --- costs before the first request ----------------------------------------------------------------------
    def calibrate(self, target: ModelRunner, draft: ModelRunner | None) -> None:
        """Time the target's 1..k_max+1-token forwards and the draft's step at batch 1 before the first request
        (calibration.py), so adaptive choices start from measured costs. No-op without adaptive choices or with
        injected costs."""
        self._runners = (target, draft)
        if self.adaptive is None or self.spec_config.cost_model is not None:
            return
        calibrate(self.cost_model, target, draft, self.k_max, min(self.max_positions, self.max_model_len))

    def reset_adaptive(self) -> None:
        """Forget what adaptive k measured and estimated (a fresh cost model and acceptance): a cold start, as a new
        engine has, for an engine that was warmed up (benchmarks); calibrated again if it was. No-op without
        adaptive k or with injected costs."""
        if self.adaptive is None or self.spec_config.cost_model is not None:
            return
        self.cost_model = MeasuredCostModel(is_model_free=not self.spec_config.drafts_with_a_model)
        self.adaptive = self._new_adaptive()
        self.timer.clear()  # forwards timed for the forgotten model
        if self._runners is not None:
            self.calibrate(*self._runners)

    def _new_adaptive(self) -> AdaptiveK:
        spec = self.spec_config
        return AdaptiveK(self.k_max, self.cost_model, tree_nodes=spec.tree_nodes if spec.measures_trees else None,
                         adapt_depth=spec.adaptive)


class StepTiming:
    """One step's timed regions (``SpeculationPolicy.timing``): each feeds the cost model when it completes."""

    def __init__(self, policy: SpeculationPolicy, device: torch.device):
        self.policy, self.device = policy, device

    @contextlib.contextmanager
    def target(self, batch_size: int, num_tokens: int, tree: bool = False) -> Iterator[None]:
        """The target forward of ``batch_size`` requests and ``num_tokens`` new tokens (``tree``: tree windows)."""
        timer, start = self.policy.timer, self.policy.timer.start(self.device)
        yield
        cost_model = self.policy.cost_model
        timer.stop(start, functools.partial(cost_model.observe_target, batch_size, num_tokens, tree=tree))

    @contextlib.contextmanager
    def tree_draft(self, batch_size: int, depth: int) -> Iterator[None]:
        """A tree round's whole drafting (a draft model reads the host at every depth anyway)."""
        timer, start = self.policy.timer, self.policy.timer.start(self.device)
        yield
        timer.stop(start, functools.partial(self.policy.cost_model.observe_tree_draft, batch_size, depth))
