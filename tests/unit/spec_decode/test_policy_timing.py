"""Adaptive k's timings through ``SpeculationPolicy.timing``: a step timed with ``enabled=False`` (a retried half of a
failed step: not the batch size the costs are kept for) times nothing, the draft model's steps neither; a step that
raises records nothing on its way out; ``reset_adaptive`` drops the timings of the forgotten cost model."""

from __future__ import annotations

import pytest
import torch
from helpers import small_llm

from specdec import SamplingParams, SpeculativeConfig
from specdec.spec_decode.cost_model import FixedCostModel

CPU = torch.device("cpu")
GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


@pytest.fixture
def llm(tiny_pair):
    """Self-drafting with injected free costs: adaptive k always drafts k = 3 (pure steps 1 and 2 are timed), whatever
    the machine's load."""
    return small_llm(tiny_pair[0], dtype="float32", block_size=4, max_model_len=128, speculative=SpeculativeConfig(
        draft_model=tiny_pair[0], num_speculative_tokens=3, adaptive=True, cost_model=FixedCostModel(c=0.0)))


def record_draft_timings(policy) -> list[int]:
    seen: list[int] = []
    real = policy.cost_model.observe_draft
    policy.cost_model.observe_draft = lambda batch_size, seconds: (seen.append(batch_size), real(batch_size, seconds))
    return seen


def test_a_disabled_timing_pauses_the_draft_models_timed_steps(llm):
    policy = llm.engine.speculative.policy
    seen = record_draft_timings(policy)
    with policy.timing(CPU, enabled=False) as timing:
        assert timing is None and policy.timer.paused
        llm.generate(prompt_token_ids=[[5, 6, 7, 8]], sampling_params=GREEDY)
    assert seen == [] and not policy.timer.paused
    llm.generate(prompt_token_ids=[[5, 6, 7, 8]], sampling_params=GREEDY)
    assert seen, "the draft model's pure steps were never timed: the test would prove nothing"


def test_a_step_that_raises_records_no_timing_and_reset_drops_pending_ones(llm):
    policy = llm.engine.speculative.policy
    recorded = []
    with pytest.raises(RuntimeError, match="boom"):
        with policy.timing(CPU) as timing:
            with timing.target(1, 1):
                pass
            policy.timer._pending.append((None, None, recorded.append))  # a CUDA timing still in flight
            raise RuntimeError("boom")
    assert policy.timer._pending, "a step that raised flushed its timings"
    policy.spec_config.cost_model = None  # reset_adaptive keeps injected costs: let it reset this once
    policy.reset_adaptive()
    assert policy.timer._pending == [] and recorded == []
