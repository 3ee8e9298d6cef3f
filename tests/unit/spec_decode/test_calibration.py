"""Start-up calibration of adaptive k's cost model (specdec/spec_decode/calibration.py): an adaptive engine has
measured the target's 1..k+1-token forwards and the draft step before its first request, leaves its pools as it
found them, and still decodes losslessly; nothing is timed where the costs are injected or there is no room."""

from __future__ import annotations

from helpers import small_llm

from specdec import SamplingParams, SpeculativeConfig
from specdec.spec_decode.calibration import calibrate
from specdec.spec_decode.cost_model import FixedCostModel, MeasuredCostModel

K = 3


def adaptive_llm(tiny_pair, **spec_kwargs):
    target, draft = tiny_pair
    spec = SpeculativeConfig(method="draft_model", draft_model=draft, num_speculative_tokens=K, adaptive=True,
                             **spec_kwargs)
    return small_llm(target, dtype="float32", max_model_len=256, num_kv_blocks=64, speculative=spec)


def test_an_adaptive_engine_starts_with_every_cost_key_measured(tiny_pair):
    llm = adaptive_llm(tiny_pair)
    cm = llm.engine.speculative.policy.cost_model
    assert isinstance(cm, MeasuredCostModel)
    keys = cm._target[1]
    assert sorted(keys) == list(range(1, K + 2))  # batch 1, windows of 1..k+1 tokens
    for samples in keys.values():  # each key answers for itself (its own median), not from a fitted line
        assert len(samples.recent) >= cm.min_samples
    assert len(cm._draft[1].recent) >= 1
    # costs are the measured ones, not the priors
    assert cm.draft_cost(1) != cm.prior_c and cm.verify_cost(K, 1) != 1 + cm.prior_slope * K
    # the scratch sequence gave its blocks back: only the static forward's scratch block (-1) is held
    for bm in llm.engine.block_managers:
        assert set(bm._tables) <= {-1}
        assert bm.num_free_blocks == bm.num_blocks - sum(len(t) for t in bm._tables.values())


def test_calibrated_engine_is_still_lossless(tiny_pair, tiny_pair_plain):
    llm = adaptive_llm(tiny_pair)
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    prompts = [[5, 6, 7, 8, 9], [1, 2, 3, 1, 2, 3, 1, 2]]
    got = [o.outputs[0].token_ids for o in llm.generate(prompt_token_ids=prompts, sampling_params=params)]
    want = [o.outputs[0].token_ids for o in tiny_pair_plain.generate(prompt_token_ids=prompts, sampling_params=params)]
    assert got == want


def test_injected_costs_are_not_calibrated(tiny_pair):
    fixed = FixedCostModel(c=0.1, verify_slope=0.0)
    llm = adaptive_llm(tiny_pair, cost_model=fixed)
    assert llm.engine.speculative.policy.cost_model is fixed  # nothing replaced, nothing timed into it


def test_no_room_in_the_pool_means_no_calibration_and_no_error(tiny_pair):
    llm = adaptive_llm(tiny_pair)
    runner = llm.engine.runner
    bm = runner.block_manager
    hog = -77
    bm.allocate(hog, (bm.num_free_blocks - 1) * bm.block_size)  # leave one block: too little to calibrate in
    free_before = bm.num_free_blocks
    cm = MeasuredCostModel()
    calibrate(cm, runner, None, K, max_len=256)
    assert cm._target == {} and bm.num_free_blocks == free_before
    bm.free(hog)
