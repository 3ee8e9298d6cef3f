"""End-to-end proof that speculative SAMPLING with DETERMINISTIC (one-hot) drafts is lossless.

Model-free drafters ("prompt_lookup", "ngram_table") propose tokens without a distribution: q is a point mass at the
draft x, so verification accepts x with probability p(x) and after a rejection draws from p with x zeroed
(renormalised). Then P(y) = p(x) [y = x] + (1 - p(x)) p(y) [y != x] / (1 - p(x)) = p(y) whatever x is, as long as
the drafts depend on the emitted prefix only. "combined" (prompt lookup when it matches, else the draft model)
puts one-hot rows and draft-model rows (q = the draft's distribution) into the same verification batch. "suffix"
drafts from the outputs of earlier requests too, and "pick" chooses its drafter by earlier rounds' outcomes: both
depend on other requests' draws, never on the request's own future ones.

Setup: the target/draft pair, exact oracle and statistic of tests/oracle.py (vocabulary 4; exact joint of
tokens 1..m from transformers' logits and an independent float64 standardization; Pearson chi-square with pooling
against the quantile at ALPHA = 1e-6; every request seeded, so each run is deterministic). The prompt repeats
"1 1 1 0 3" and ends in 1, so prompt lookup matches after the likely first tokens (t1 = 1 or 0, ~70%: "1 1" and
"1 0" occurred) and misses after t1 = 2 or 3 (a plain step, or the draft model for "combined", so its batches mix
both row kinds); the n-gram tables (seeded from the prompt) predict after every token. Lookups hitting the likely
paths matter: drafts proposed only inside low-probability prefixes land in the pooled cell, where the chi-square
cannot see them (with a "0 1 2 3" prompt both mutants of "combined" went undetected). Every request generates
m = k + 2 tokens.

Coverage asserted per case: from the request metrics, rounds that ended in a rejection and all-accepted rounds;
from a pass-through spy on the accept/reject op, one-hot rows with both outcomes (for "combined" also model rows,
and batches that mixed both kinds).

Planted mutants (each one place, via monkeypatch) must push the statistic over the same bound for every method:
  (a) onehot_residual_keeps_draft: after a one-hot rejection the token is drawn from p, not p with x zeroed (the
      one-hot q never subtracted, e.g. the kernel's main residual call passing onehot_token = -1);
  (b) onehot_q_read_as_zero: the one-hot flag ignored, q(x) read from the zero-filled draft_probs rows (what
      CombinedProposer stores for one-hot requests, or a masked load defaulting to 0 when draft_probs is None):
      u * 0 < p(x) accepts every draft with p(x) > 0 (a soft q(x) = p(x) taken from the wrong row does the same).
Both only touch one-hot rows, so for "combined" they prove the one-hot rows of mixed batches are what is tested.
On CPU the op is the torch reference (specdec.kernels.spec_sample.spec_sample_reference).
"""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from oracle import CONFIGS, check, exact_joint, lossless_llm, memoised, run, target_prefix_logits

import specdec
from specdec.kernels import spec_sample as spec_sample_module
from specdec.spec_decode import verify as verify_module

PROMPT = [1, 1, 1, 0, 3, 1, 1, 1, 0, 3, 1]
N = 3000  # requests per run of the true engine
N_MUTANT = 1000  # requests per mutant run (their statistics land far above the bound)
MIN_OUTCOMES = N // 20  # least number of rounds of each outcome (rejection / all accepted) a case must contain
MIN_MODEL_OUTCOMES = N // 100  # the same for the draft-model rows of "combined" (rare under top-k / top-p)

# (method, config, k): m = k + 2 tokens per request
CASES = [
    ("prompt_lookup", "temperature_1", 2), ("prompt_lookup", "top_k_top_p", 3), ("prompt_lookup", "penalties", 2),
    ("ngram_table", "temperature_1", 2), ("ngram_table", "top_k_top_p", 2), ("ngram_table", "penalties", 2),
    ("combined", "temperature_1", 2), ("combined", "top_k_top_p", 2), ("combined", "penalties", 2),
    ("suffix", "temperature_1", 2), ("pick", "temperature_1", 2), ("pick", "penalties", 2),
]
METHODS = ("prompt_lookup", "ngram_table", "combined", "pick")
MUTANT_CASE = ("temperature_1", 2)
MAX_M = max(k for *_, k in CASES) + 2


@pytest.fixture(scope="module")
def prefix_logits(model_dirs):
    return target_prefix_logits(model_dirs[0], PROMPT, MAX_M)


@pytest.fixture(scope="module")
def make_llm(model_dirs):
    """``make_llm(method, k)``: the speculative LLM (one per (method, k) for the whole module)."""
    target, draft = model_dirs

    def build(method: str, k: int):
        return lossless_llm(target, specdec.SpeculativeConfig(method=method, num_speculative_tokens=k,
                                                              draft_model=draft if method == "combined" else None))

    return memoised(build)


def round_outcomes(metrics: list[dict]) -> tuple[int, int]:
    """(rounds that ended in a rejection, all-accepted rounds) over all requests, from the metrics alone:
    alpha = accepted / (accepted + rejected rounds), and accepted = 0 means every round was rejected."""
    rejected = rounds = 0
    for x in metrics:
        rounds += x["num_rounds"]
        if x["num_rounds"]:
            rejected += round(x["accepted"] * (1 - x["alpha"]) / x["alpha"]) if x["accepted"] else x["num_rounds"]
    return rejected, rounds - rejected


def spy_on_verification(monkeypatch) -> Counter:
    """Pass-through spy on the accept/reject op: per row kind (onehot / model), rounds, rejected rounds and
    all-accepted rounds; ``mixed`` counts batches holding both kinds."""
    real, tally = verify_module.ops.spec_sample, Counter()

    def spec_sample(draft_ids, cu, draft_probs, target_probs, target_argmax, is_greedy, is_onehot, *rest):
        out, num_accepted = real(draft_ids, cu, draft_probs, target_probs, target_argmax, is_greedy, is_onehot, *rest)
        onehot = torch.ones_like(is_onehot) if draft_probs is None else is_onehot
        num_drafts = (cu[1:] - cu[:-1]).long()
        for kind, rows in (("onehot", onehot), ("model", ~onehot)):
            tally[f"{kind} rounds"] += int(rows.sum())
            tally[f"{kind} rejected"] += int((rows & (num_accepted.long() < num_drafts)).sum())
            tally[f"{kind} all-accepted"] += int((rows & (num_accepted.long() == num_drafts)).sum())
        tally["mixed"] += bool(onehot.any() and (~onehot).any())
        return out, num_accepted

    monkeypatch.setattr(verify_module.ops, "spec_sample", spec_sample)
    return tally


# --- the true engine -------------------------------------------------------------------------------------------
@pytest.mark.parametrize("method,case,k", CASES, ids=[f"{method}-{case}-k{k}" for method, case, k in CASES])
def test_onehot_speculative_sampling_matches_exact_joint(make_llm, prefix_logits, monkeypatch, method, case, k):
    cfg, m, label = CONFIGS[case], k + 2, f"{method} {case} k={k}"
    tally = spy_on_verification(monkeypatch)
    counts, metrics = run(make_llm(method, k), cfg, m, N, label, PROMPT)
    stat, bound = check(label, counts, exact_joint(prefix_logits, cfg, m, PROMPT))
    assert stat < bound, f"{label}: one-hot speculative sampling is not lossless (chi-square {stat:.1f} >= {bound:.1f})"
    rejected, all_accepted = round_outcomes(metrics)
    drafted, accepted = sum(x["drafted"] for x in metrics), sum(x["accepted"] for x in metrics)
    print(f"\n[{label}] metrics: acceptance {accepted / drafted:.2f}, rounds ending in a rejection {rejected}, "
          f"all-accepted rounds {all_accepted}; spy: {dict(sorted(tally.items()))}", end="")
    assert rejected > MIN_OUTCOMES and all_accepted > MIN_OUTCOMES
    # the metrics count exactly the rounds the op verified
    assert (rejected, all_accepted) == (tally["onehot rejected"] + tally["model rejected"],
                                        tally["onehot all-accepted"] + tally["model all-accepted"])
    assert tally["onehot rejected"] > MIN_OUTCOMES and tally["onehot all-accepted"] > MIN_OUTCOMES
    if method == "combined":
        assert tally["model rejected"] > MIN_MODEL_OUTCOMES and tally["model all-accepted"] > MIN_MODEL_OUTCOMES
        assert tally["mixed"] > 0, "no verification batch mixed one-hot and draft-model rows"
    else:
        assert tally["model rounds"] == 0


# --- planted mutants -------------------------------------------------------------------------------------------
def plant_onehot_residual_keeps_draft(monkeypatch):
    """(a) a rejected one-hot draft is not zeroed in the residual: rows whose q is a point mass get p itself."""
    real = spec_sample_module.residual_distribution

    def residual_distribution(p, q):
        return torch.where((q == 1).any(dim=-1, keepdim=True), p, real(p, q))

    monkeypatch.setattr(spec_sample_module, "residual_distribution", residual_distribution)


def plant_onehot_q_read_as_zero(monkeypatch):
    """(b) the op ignores draft_is_onehot and reads q(x) from zero-filled draft_probs rows: accept iff p(x) > 0."""
    real = verify_module.ops.spec_sample

    def spec_sample(draft_ids, cu, draft_probs, target_probs, target_argmax, is_greedy, is_onehot, *rest):
        if draft_probs is None:
            draft_probs = target_probs.new_zeros(draft_ids.shape[0], target_probs.shape[1])
        return real(draft_ids, cu, draft_probs, target_probs, target_argmax, is_greedy,
                    torch.zeros_like(is_onehot), *rest)

    monkeypatch.setattr(verify_module.ops, "spec_sample", spec_sample)


MUTANTS = {
    "onehot_residual_keeps_draft": plant_onehot_residual_keeps_draft,
    "onehot_q_read_as_zero": plant_onehot_q_read_as_zero,
}


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("mutant", list(MUTANTS))
def test_planted_onehot_mutant_is_rejected(make_llm, prefix_logits, monkeypatch, mutant, method):
    case, k = MUTANT_CASE
    cfg, m, label = CONFIGS[case], k + 2, f"mutant {mutant} ({method} {case} k={k})"
    MUTANTS[mutant](monkeypatch)
    counts, _ = run(make_llm(method, k), cfg, m, N_MUTANT, label, PROMPT)
    stat, bound = check(label, counts, exact_joint(prefix_logits, cfg, m, PROMPT))
    assert stat > bound, f"{label} was not detected (chi-square {stat:.1f} <= {bound:.1f})"
