"""End-to-end proof that speculative SAMPLING is lossless: ``LLM(..., speculative=...)`` against an exact oracle.

A tiny target (vocabulary of 4, fp32, no tokenizer) and a draft (the target plus noise, acceptance 0.4-0.7)
run through the real engine: draft model, paged KV caches, ragged verification, the accept/reject op, rollback
and draft catch-up. Every request generates ``m = k + 2`` tokens from one fixed prompt with its own seed, so the
first token is a plain sample, the next k are drafted and verified, and the last one is the bonus token (all
accepted) or comes from a later, shorter round or a plain step.

Oracle and statistic: tests/oracle.py (transformers' logits of every prefix, an independent float64
standardization, the exact joint of tokens 1..m, Pearson's chi-square at ALPHA = 1e-6). Every request is
seeded, so each run is deterministic: the test either always passes or always fails, never flakes.

Planted mutants (each one place, via monkeypatch) must push the statistic over the same bound:
  (a) the residual drawn from p instead of max(p - q, 0);
  (b) the accept test (and residual) using the UNFILTERED q while drafts were drawn from the filtered q;
  (c) the bonus token drawn from the unfiltered p.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from oracle import CONFIGS, N_MUTANT, PROMPT, N, check, exact_joint, lossless_llm, memoised, run, target_prefix_logits

import specdec
from specdec.kernels import spec_sample as spec_sample_module
from specdec.sampling import sampler as sampler_module
from specdec.spec_decode import verify as verify_module
from specdec.spec_decode.proposers import chain_drafting as chain_drafting_module

# (config, k): m = k + 2 tokens per request - 1 plain, k drafted, then the bonus (or a later round / plain step)
CASES = [("temperature_1", 2), ("top_k_top_p", 2), ("penalties", 2), ("top_k_top_p", 3)]
MUTANT_CASE = ("top_k_top_p", 2)
MAX_M = max(k for _, k in CASES) + 2


@pytest.fixture(scope="module")
def prefix_logits(model_dirs) -> dict[tuple[int, ...], torch.Tensor]:
    """float64 next-token logits of transformers' target after PROMPT + every prefix of length < MAX_M."""
    return target_prefix_logits(model_dirs[0], PROMPT, MAX_M)


@pytest.fixture(scope="module")
def make_llm(model_dirs):
    """``make_llm(k)``: the speculative LLM with k drafts per round (one per k for the whole module)."""
    target, draft = model_dirs
    return memoised(lambda k: lossless_llm(target, specdec.SpeculativeConfig(draft_model=draft,
                                                                             num_speculative_tokens=k)))  # fmt: skip


# --- the true engine -------------------------------------------------------------------------------------------
@pytest.mark.parametrize("case,k", CASES, ids=[f"{case}-k{k}" for case, k in CASES])
def test_speculative_sampling_matches_exact_joint(make_llm, prefix_logits, case, k):
    cfg, m, label = CONFIGS[case], k + 2, f"{case} k={k}"
    counts, metrics = run(make_llm(k), cfg, m, N, label)
    stat, bound = check(label, counts, exact_joint(prefix_logits, cfg, m))
    assert stat < bound, f"{label}: speculative sampling is not lossless (chi-square {stat:.1f} >= {bound:.1f})"
    # Both branches of verification ran: rounds ending in a rejection, and first rounds that accepted all k
    # drafts (so the m-th token is the bonus token).
    drafted = sum(x["drafted"] for x in metrics)
    accepted = sum(x["accepted"] for x in metrics)
    rejected = sum(x["accepted"] < x["drafted"] for x in metrics)
    all_accepted = sum(x["num_rounds"] == 1 and x["drafted"] == x["accepted"] == k for x in metrics)
    print(f"\n[{label}] acceptance {accepted / drafted:.2f}, requests with a rejection {rejected}, "
          f"requests whose first round accepted all {k} drafts {all_accepted}", end="")
    assert 0.3 < accepted / drafted < 0.9
    assert rejected > N // 10 and all_accepted > N // 10


# --- planted mutants -------------------------------------------------------------------------------------------
def plant_residual_from_p(monkeypatch):
    """(a) after a rejection, draw the token from p instead of norm(max(p - q, 0))."""
    monkeypatch.setattr(spec_sample_module, "residual_distribution", lambda p, q: p.clone())


def plant_unfiltered_q(monkeypatch):
    """(b) drafts are still drawn from the filtered q, but the accept test / residual get the unfiltered q."""
    real = sampler_module.sample_rows

    def sample_rows(logits, params, *args, **kwargs):
        tokens, _ = real(logits, params, *args, **kwargs)
        unfiltered = [dataclasses.replace(p, top_k=0, top_p=1.0, min_p=0.0) for p in params]
        return tokens, real(logits, unfiltered, *args, **{**kwargs, "bad_rows": []})[1]

    monkeypatch.setattr(chain_drafting_module, "sample_rows", sample_rows)


def plant_bonus_from_unfiltered_p(monkeypatch):
    """(c) the bonus rows of target_probs (row cu[b] + b + k_b of request b) hold the unfiltered p."""
    real_standardize, real_spec_sample = verify_module.to_probs_unchecked, verify_module.ops.spec_sample
    unfiltered = {}

    def standardize(logits, st):
        unfiltered["p"] = real_standardize(logits, dataclasses.replace(st, any_filter=False))[0]
        return real_standardize(logits, st)

    def spec_sample(draft_ids, cu, draft_probs, target_probs, *args):
        bonus_rows = cu[1:].long() + torch.arange(cu.shape[0] - 1)
        target_probs = target_probs.clone()
        target_probs[bonus_rows] = unfiltered["p"][bonus_rows]
        return real_spec_sample(draft_ids, cu, draft_probs, target_probs, *args)

    monkeypatch.setattr(verify_module, "to_probs_unchecked", standardize)
    monkeypatch.setattr(verify_module.ops, "spec_sample", spec_sample)


MUTANTS = {
    "residual_from_p": plant_residual_from_p,
    "accept_with_unfiltered_q": plant_unfiltered_q,
    "bonus_from_unfiltered_p": plant_bonus_from_unfiltered_p,
}


@pytest.mark.parametrize("mutant", list(MUTANTS))
def test_planted_mutant_is_rejected(make_llm, prefix_logits, monkeypatch, mutant):
    case, k = MUTANT_CASE
    cfg, m, label = CONFIGS[case], k + 2, f"mutant {mutant} ({case} k={k})"
    MUTANTS[mutant](monkeypatch)
    counts, _ = run(make_llm(k), cfg, m, N_MUTANT, label)
    stat, bound = check(label, counts, exact_joint(prefix_logits, cfg, m))
    assert stat > bound, f"{label} was not detected (chi-square {stat:.1f} <= {bound:.1f})"
