"""N-gram, prompt-lookup and combined drafting end to end; adaptive speculation length."""

import random

import pytest
import torch
from helpers import small_llm

from specdec import SamplingParams, SpeculativeConfig
from specdec.spec_decode.adaptive import AdaptiveK
from specdec.spec_decode.cost_model import FixedCostModel, MeasuredCostModel, expected_speedup


def test_no_prediction_means_a_plain_step_without_verification(tiny_pair):
    llm = small_llm(tiny_pair[0], dtype="float32", block_size=4, max_model_len=256,
                      speculative=SpeculativeConfig(method="prompt_lookup", num_speculative_tokens=4,
                                                    prompt_lookup_min=3))
    out = llm.generate(prompt_token_ids=[[1, 2, 3, 4, 5, 6, 7, 8]], sampling_params=SamplingParams(
        temperature=0, max_tokens=3, ignore_eos=True))[0]
    # no 3-token suffix ever repeats in 8 distinct tokens + 2 new ones: no drafts, no rounds, one forward per token
    assert out.metrics["drafted"] == 0 and out.metrics["num_rounds"] == 0
    assert out.metrics["target_forwards"] == 3


def test_adaptive_k_prefers_long_drafts_when_acceptance_is_high_and_switches_off_when_low():
    costs = FixedCostModel(c=0.0, verify_slope=0.25)
    ada = AdaptiveK(k_max=6, cost_model=costs, probe_every=4)
    for _ in range(20):
        ada.observe(1, drafted=6, accepted=6)
        ada.observe(2, drafted=3, accepted=0)
    assert ada.choose(1, batch_size=1, k_cap=6) == 6
    assert ada.choose(1, batch_size=1, k_cap=2) == 2  # guards cap it
    choices = [ada.choose(2, batch_size=1, k_cap=6) for _ in range(8)]
    # off, with probes after 2 plain steps, then 4 (the back-off, capped at probe_every): the best-valued k >= 1,
    # then the k gone longest without (here 5: 6 and 2 were chosen above for request 1 at this batch size, 1 just now)
    assert choices == [0, 1, 0, 0, 0, 5, 0, 0]
    # a costly draft model shortens k at the same acceptance
    mid = FixedCostModel(c=0.0, verify_slope=0.05)
    pricey = FixedCostModel(c=0.6, verify_slope=0.05)
    rng = random.Random(0)
    rounds = []  # rounds of 8 drafts, each accepted with probability 0.8 given the earlier ones were
    for _ in range(40):
        accepted = 0
        while accepted < 8 and rng.random() < 0.8:
            accepted += 1
        rounds.append(accepted)
    for model, name in ((mid, "free"), (pricey, "pricey")):
        a = AdaptiveK(k_max=8, cost_model=model)
        for accepted in rounds:
            a.observe(0, drafted=8, accepted=accepted)
        if name == "free":
            k_free = a.choose(0, 1, 8)
        else:
            k_pricey = a.choose(0, 1, 8)
    assert k_free > k_pricey >= 0
    assert expected_speedup(0.0, 0, 0.3, 1.0) == 1.0


def test_measured_cost_model_fits_the_target_line_and_the_draft_ratio():
    cm = MeasuredCostModel()
    assert cm.verify_cost(3, 2) == pytest.approx(1.3)  # prior until there is data
    for n, t in ((2, 0.010), (4, 0.012), (8, 0.016)):  # batch 2: 10 ms + 1 ms per extra token
        cm.observe_target(2, n, t)
    cm.observe_draft(2, 0.004)
    assert cm.verify_cost(0, 2) == 1.0
    assert cm.verify_cost(1, 2) == pytest.approx(1.2)
    assert cm.verify_cost(5, 2) == pytest.approx(2.0)  # 12 tokens, extrapolated on the fitted line
    assert cm.draft_cost(2) == pytest.approx(0.4)
    assert MeasuredCostModel(is_model_free=True).draft_cost(2) == 0.0


@pytest.fixture(scope="module")
def smollm2():
    from specdec.checkpoint.default_model import default_model_path

    return default_model_path()


def test_adaptive_k_settles_to_zero_on_random_tokens_and_stays_up_on_repetition(smollm2):
    costs = FixedCostModel(c=0.0, verify_slope=0.25)
    llm = small_llm(smollm2, dtype="float32", max_model_len=512, speculative=SpeculativeConfig(
        method="ngram_table", num_speculative_tokens=4, adaptive=True, cost_model=costs))
    gen = torch.Generator().manual_seed(0)
    random_tokens = torch.randint(1000, 30000, (40,), generator=gen).tolist()
    noisy = llm.generate(prompt_token_ids=[random_tokens], sampling_params=SamplingParams(
        temperature=1.0, max_tokens=40, seed=0, ignore_eos=True))[0].metrics
    settled = noisy["k_per_step"][-8:]  # off, but for at most one probe (gaps of 8 and 16 steps by then)
    assert sum(1 for k in settled if k) <= 1 and noisy["accepted"] <= noisy["drafted"] // 3, noisy["k_per_step"]
    text = "red, green, blue, red, green, blue, red, green, blue, red, green, blue, red,"
    repetitive = llm.generate([text], SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))[0].metrics
    ks = repetitive["k_per_step"]
    assert min(ks[-4:]) > 0 and max(ks) == 4 and repetitive["acceptance_rate"] > 0.8
