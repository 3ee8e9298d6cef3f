"""Losslessness of speculative sampling, tested statistically on the torch reference (fast, vectorised).

A tiny first-order Markov "language model" stands in for the target and the draft: conditional tables
``P[prev] = p(. | prev)`` and ``Q[prev] = q(. | prev)`` over a vocabulary of 8 (row ``V`` is the start state),
both standardized with the SAME transform (temperature -> softmax -> top-k -> top-p, the contract's reference
functions). Every row of one ``spec_sample_reference`` call is an independent request (its own seed). Drafts
are drawn from the filtered q with Philox (STREAM_DRAFT), exactly as a draft model would. A request that ends
its first round after one token runs a second round from the new prefix, so every request yields its first two
generated tokens, whose joint must be ``P[start, a] * P[a, b]`` and whose first token must follow ``P[start]``.

Bound: Pearson's chi-square per (k group, first-token or joint) table. Cells with expected count < 20 are
pooled into one cell so the chi-square approximation holds; cells with zero target probability must stay
empty (tokens outside p's support are an exact failure). The critical value is the chi-square quantile at
significance 1e-6 split over all tables of a test (Bonferroni), computed from the regularized incomplete gamma
function. Planted mutants (wrong residual, unfiltered q in the accept test, bonus from the unfiltered p) must
push at least one table over the same bound.
"""

from __future__ import annotations

import math

import pytest
import torch
from stats_helpers import chi2_isf

from specdec.kernels import spec_sample as spec_sample_module
from specdec.kernels.inverse_cdf import sample_inverse_cdf_reference as sample_inverse_cdf
from specdec.kernels.philox import STREAM_DRAFT
from specdec.kernels.softmax import softmax_with_temperature_reference
from specdec.kernels.spec_sample import spec_sample_reference
from specdec.kernels.top_k_top_p import top_k_top_p_min_p_reference

VOCAB = 8
START = VOCAB  # the start state's row in the conditional tables
ROWS_PER_GROUP = 25_000
DRAFT_LENGTHS = (0, 1, 2, 3)  # one group of requests per k; k = 0 is a bonus-only round
ALPHA = 1e-6
MIN_EXPECTED = 20.0
TEMPERATURE, TOP_K, TOP_P = 0.9, 5, 0.9


def chi_square(counts: torch.Tensor, probs: torch.Tensor) -> tuple[float, int]:
    """(Pearson statistic, degrees of freedom) of ``counts`` against ``probs``; inf if p = 0 cells are hit."""
    counts, probs = counts.flatten().double(), probs.flatten().double()
    if counts[probs == 0].sum() > 0:
        return math.inf, 1
    expected = probs * counts.sum()
    small = (expected < MIN_EXPECTED) & (probs > 0)
    big = expected >= MIN_EXPECTED
    obs = torch.cat([counts[big], counts[small].sum()[None]]) if small.any() else counts[big]
    exp = torch.cat([expected[big], expected[small].sum()[None]]) if small.any() else expected[big]
    return float(((obs - exp) ** 2 / exp).sum()), max(int(obs.numel()) - 1, 1)


def standardize(logits: torch.Tensor, filtered: bool = True) -> torch.Tensor:
    """The contract's transform with this test's settings, rows of ``logits [R, V]``."""
    rows = logits.shape[0]
    probs, bad = softmax_with_temperature_reference(logits, torch.full((rows,), TEMPERATURE))
    assert not bad.any()
    if not filtered:
        return probs
    k = torch.full((rows,), TOP_K, dtype=torch.int64)
    return top_k_top_p_min_p_reference(probs, k, torch.full((rows,), TOP_P), torch.zeros(rows))


def make_model(seed: int = 0) -> dict[str, torch.Tensor]:
    """Target and draft conditional tables [V + 1, V] (filtered and unfiltered) and a deterministic drafter."""
    gen = torch.Generator().manual_seed(seed)
    target_logits = 1.5 * torch.randn(VOCAB + 1, VOCAB, generator=gen)
    draft_logits = target_logits + 0.8 * torch.randn(VOCAB + 1, VOCAB, generator=gen)
    # n-gram style deterministic drafter: a fixed guess per context, the target's mode except in contexts 0 and 1,
    # which guess their least likely token (outside p's support: always rejected).
    ngram = target_logits.argmax(dim=-1)
    ngram[:2] = target_logits[:2].argmin(dim=-1)
    return {
        "P": standardize(target_logits),
        "Q": standardize(draft_logits),
        "P_unfiltered": standardize(target_logits, filtered=False),
        "Q_unfiltered": standardize(draft_logits, filtered=False),
        "target_argmax": target_logits.argmax(dim=-1),
        "ngram": ngram,
    }


def run_round(model, prev, seeds, positions, num_drafts, *, onehot=False, accept_q="Q", bonus_p="P"):
    """One speculative round per row (all rows independent requests). Returns (tokens [R, K + 1], accepted [R]).

    ``accept_q`` / ``bonus_p`` name the tables handed to the verifier for q and for the bonus row; the
    drafts are always drawn from the filtered ``Q`` (the mutants change only what the verifier is given).
    """
    rows, max_k = prev.shape[0], int(num_drafts.max())
    contexts = [prev]  # contexts[j] = token before position j
    for j in range(max_k):
        if onehot:
            draft = model["ngram"][contexts[-1]]
        else:
            # inverse CDF with one uniform per row, as a draft model samples (sample_from_probs)
            draft = sample_inverse_cdf(model["Q"][contexts[-1]], seeds, positions + j, STREAM_DRAFT)
        contexts.append(draft)
    ctx = torch.stack(contexts, dim=1)  # (R, K + 1)
    j = torch.arange(max_k + 1)
    has_draft = j[None, :max_k] < num_drafts[:, None]  # (R, K)
    has_target = j[None, :] <= num_drafts[:, None]  # (R, K + 1)
    is_bonus = j[None, :] == num_drafts[:, None]  # (R, K + 1)
    target = torch.where(is_bonus[..., None], model[bonus_p][ctx], model["P"][ctx])  # (R, K + 1, V)
    cu = torch.zeros(rows + 1, dtype=torch.int32)
    cu[1:] = num_drafts.cumsum(0)
    return spec_sample_reference(
        draft_token_ids=ctx[:, 1:][has_draft],  # row-major flattening = the cu layout
        cu_num_draft_tokens=cu,
        draft_probs=None if onehot else model[accept_q][ctx[:, :max_k]][has_draft],
        target_probs=target[has_target],
        target_argmax=model["target_argmax"][ctx][has_target],
        is_greedy=torch.zeros(rows, dtype=torch.bool),
        draft_is_onehot=torch.full((rows,), onehot),
        seeds=seeds,
        positions=positions,
        max_num_draft_tokens=max_k,
    )


def first_two_tokens(model, **mutation):
    """(t1, t2, num_drafts, round-1 accepted) for ROWS_PER_GROUP requests per draft length."""
    num_drafts = torch.tensor(DRAFT_LENGTHS).repeat_interleave(ROWS_PER_GROUP)  # (R,)
    rows = num_drafts.shape[0]
    gen = torch.Generator().manual_seed(1234)
    seeds = torch.randint(-(2**62), 2**62, (rows,), generator=gen)
    positions = torch.randint(0, 1 << 20, (rows,), generator=gen)
    prev = torch.full((rows,), START)
    out, accepted = run_round(model, prev, seeds, positions, num_drafts, **mutation)
    t1, t2 = out[:, 0], out[:, 1]
    need = accepted == 0  # the round emitted one token: run the next round from the new prefix
    out2, _ = run_round(model, t1[need], seeds[need], positions[need] + 1, num_drafts[need], **mutation)
    t2 = t2.clone()
    t2[need] = out2[:, 0]
    return t1, t2, num_drafts, accepted


def lossless_tables(model, run) -> list[tuple[str, float, float]]:
    """(name, chi-square statistic, Bonferroni bound) for the first-token and joint table of every k group."""
    t1, t2, num_drafts, _ = run
    first_p = model["P"][START]  # (V,)
    joint_p = first_p[:, None] * model["P"][:VOCAB]  # (V, V) P[start, a] * P[a, b]
    num_tables = 2 * len(DRAFT_LENGTHS)
    results = []
    for k in DRAFT_LENGTHS:
        group = num_drafts == k
        first_counts = torch.bincount(t1[group], minlength=VOCAB)
        joint_counts = torch.bincount(t1[group] * VOCAB + t2[group], minlength=VOCAB * VOCAB)
        for name, counts, probs in (("first", first_counts, first_p), ("joint", joint_counts, joint_p)):
            stat, df = chi_square(counts, probs)
            results.append((f"k={k} {name}", stat, chi2_isf(ALPHA / num_tables, df)))
    return results


def _format(results) -> str:
    return "\n".join(f"  {name:12s} chi2={stat:10.1f}  bound={bound:6.1f}" for name, stat, bound in results)


@pytest.fixture(scope="module")
def model():
    m = make_model()
    assert (m["P"] == 0).any() and (m["Q"] == 0).any(), "the filters must cut something for the mutants to bite"
    return m


@pytest.fixture(scope="module", params=[False, True], ids=["draft-model", "one-hot"])
def correct_run(request, model):
    """First two tokens of every request with the unmodified reference (shared by the tests below)."""
    return request.param, first_two_tokens(model, onehot=request.param)


def test_first_two_tokens_follow_target(model, correct_run):
    _, run = correct_run
    results = lossless_tables(model, run)
    print("\n" + _format(results))
    assert all(stat <= bound for _, stat, bound in results), "speculative output is not distributed as p:\n" + (
        _format(results)
    )


def test_rounds_both_reject_and_accept_everything(correct_run):
    _, (_, _, num_drafts, accepted) = correct_run
    for k in DRAFT_LENGTHS[1:]:
        group = num_drafts == k
        rejected = int((accepted[group] < k).sum())
        all_accepted = int((accepted[group] == k).sum())
        assert min(rejected, all_accepted) > ROWS_PER_GROUP // 100, (
            f"k={k}: {rejected} rejections, {all_accepted} all-accepted")


def _residual_from_p(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    return p.clone()


@pytest.mark.parametrize("mutant", ["residual_from_p", "accept_with_unfiltered_q", "bonus_from_unfiltered_p"])
def test_planted_mutants_are_rejected(model, mutant, monkeypatch):
    if mutant == "residual_from_p":  # (a) the recovered token drawn from p instead of max(p - q, 0)
        monkeypatch.setattr(spec_sample_module, "residual_distribution", _residual_from_p)
        mutation = {}
    elif mutant == "accept_with_unfiltered_q":  # (b) drafts from the filtered q, verifier given the unfiltered q
        mutation = {"accept_q": "Q_unfiltered"}
    else:  # (c) bonus row not filtered
        mutation = {"bonus_p": "P_unfiltered"}
    results = lossless_tables(model, first_two_tokens(model, **mutation))
    print(f"\n{mutant}:\n" + _format(results))
    assert any(stat > bound for _, stat, bound in results), f"mutant {mutant} passed the test:\n" + _format(results)
