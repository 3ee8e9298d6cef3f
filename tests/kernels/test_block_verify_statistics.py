"""Block verification is lossless, accepts at least as much as token-wise verification, and the tests can tell.

Two kinds of evidence, each with the planted mutant "block verification's acceptance computed per token" (the
weights ``w_i = min(1, p/q)`` of each position alone instead of carried across positions), which must fail both:

1. Exact enumeration (float64, no sampling): over a tiny first-order Markov target P and draft Q (V = 3..4,
   k = 1..3), every draft block x is weighed by prod Q, the algorithm's own stop probabilities
   ``h_i = r_i / (r_i + 1 - w_i)`` (built from the module's ``block_weights`` and ``residual_mass``, the steps the
   reference uses) give the distribution of tau, and the residual at tau gives the last token. The emitted
   tokens, continued by the target up to k + 1 tokens, must have exactly the target's joint
   ``prod_t P[s_{t-1}, s_t]`` (the usual validity criterion: later rounds are target-distributed by induction).
   The same enumeration gives the exact expected number of accepted drafts of block and token-wise
   verification, and shows that with one-hot drafts the two coincide (why one-hot rows fall back).
2. Monte Carlo through the reference itself (fp32, Philox): 50,000 seeded requests per group are decoded in
   rounds of block verification until each has 3 tokens; Pearson's chi-square of those 3-token joints against
   the target's, with the pooling and Bonferroni bound of test_spec_sample_statistics.py (significance 1e-6).
   Several rounds per request are the point: block verification looks at drafts beyond the tokens it emits, so
   randomness keyed by absolute position would be reused by the next round (kernels/block_verify.py). The drafts
   are drawn fresh per round (keyed by the round's start and the draft's offset, as the engine's draft model
   does under verify="block"); two more mutants key the stop uniforms, or the drafts, by each draft's own
   position instead of the round: both must fail too (the draft one needs 100,000 requests at k = 4).
"""

from __future__ import annotations

import itertools

import pytest
import torch
from stats_helpers import chi2_isf
from test_spec_sample_statistics import START, VOCAB, chi_square, make_model

from specdec.kernels import block_verify as bv
from specdec.kernels.block_verify import block_verify_reference
from specdec.kernels.inverse_cdf import sample_inverse_cdf_reference as sample_inverse_cdf
from specdec.kernels.philox import STREAM_BLOCK_ACCEPT, STREAM_DRAFT, philox_uniform, round_stream

F64 = torch.float64


# --- exact enumeration ------------------------------------------------------------------------------------------
def markov_pair(vocab: int, seed: int, noise: float = 1.0, top_k: int | None = None):
    """Target and draft tables ``[V + 1, V]`` (row V is the start state), float64; top_k zeroes the rest."""
    gen = torch.Generator().manual_seed(seed)
    target_logits = 1.5 * torch.randn(vocab + 1, vocab, generator=gen, dtype=F64)
    draft_logits = target_logits + noise * torch.randn(vocab + 1, vocab, generator=gen, dtype=F64)

    def probs(logits):
        if top_k is not None:
            kth = logits.topk(top_k, dim=-1).values[:, -1:]
            logits = logits.masked_fill(logits < kth, -torch.inf)
        return torch.softmax(logits, dim=-1)

    return probs(target_logits), probs(draft_logits)


def _residual(weight: float, p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """norm(max(w p - q, 0)), or p when that is all zero (the contract's fallback)."""
    res = torch.clamp(weight * p - q, min=0.0)
    res = res if res.sum() > 0 else p
    return res / res.sum()


def _blocks(P, Q, k):
    """(draft block x, its probability under Q, contexts (start, x_1..x_k)) for every x with prob > 0."""
    for x in itertools.product(range(P.shape[1]), repeat=k):
        ctx = (P.shape[0] - 1,) + x
        prob = float(torch.prod(torch.stack([Q[ctx[i], x[i]] for i in range(k)]))) if k else 1.0
        if prob > 0:
            yield x, prob, ctx


def block_tau_distribution(P, Q, ctx, x) -> tuple[list[float], list[float]]:
    """(Pr(tau = i) for i = 0..k, weights w_0..w_k) of block verification for one draft block."""
    k = len(x)
    p_x = torch.stack([P[ctx[i], x[i]] for i in range(k)]) if k else torch.zeros(0, dtype=F64)
    q_x = torch.stack([Q[ctx[i], x[i]] for i in range(k)]) if k else torch.zeros(0, dtype=F64)
    w = [1.0] + bv.block_weights(p_x, q_x).tolist()  # w[i] = w_i
    h = [0.0]
    for i in range(1, k + 1):
        r = float(bv.residual_mass(torch.tensor(w[i], dtype=F64), P[ctx[i]], Q[ctx[i]])) if i < k else w[i]
        denom = r + 1.0 - w[i]
        h.append(r / denom if denom > 0 else 0.0)  # 0/0: never stop here (the kernel's strict test agrees)
    tau = []
    for i in range(k + 1):
        pr = h[i] if i > 0 else 1.0
        for j in range(i + 1, k + 1):
            pr *= 1.0 - h[j]
        tau.append(pr)
    return tau, w


def token_tau_distribution(P, Q, ctx, x) -> list[float]:
    """Pr(tau = i), i = 0..k, of token-wise verification (accept each draft with min(1, p/q) until a rejection)."""
    k = len(x)
    accept = [min(1.0, float(P[ctx[i], x[i]] / Q[ctx[i], x[i]])) for i in range(k)]
    tau, prefix = [], 1.0
    for i in range(k + 1):
        tau.append(prefix * ((1.0 - accept[i]) if i < k else 1.0))
        prefix *= accept[i] if i < k else 1.0
    return tau


def emitted_distribution(P, Q, k: int, method: str = "block") -> dict[tuple[int, ...], float]:
    """Exact Pr(the round emits exactly these tokens) for one round with k drafts from the start state."""
    out: dict[tuple[int, ...], float] = {}
    for x, prob, ctx in _blocks(P, Q, k):
        if method == "block":
            tau, w = block_tau_distribution(P, Q, ctx, x)
        else:
            tau, w = token_tau_distribution(P, Q, ctx, x), [1.0] * (k + 1)
        for t, pr in enumerate(tau):
            if pr == 0:
                continue
            last = P[ctx[t]] / P[ctx[t]].sum() if t == k else _residual(w[t], P[ctx[t]], Q[ctx[t]])
            for y in range(P.shape[1]):
                key = x[:t] + (y,)
                out[key] = out.get(key, 0.0) + prob * pr * float(last[y])
    return out


def extended_joint(P, emitted: dict[tuple[int, ...], float], length: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(emitted tokens continued by the target to ``length`` tokens, the target's own joint), both ``[V] * length``."""
    vocab, start = P.shape[1], P.shape[0] - 1
    joint = torch.zeros((vocab,) * length, dtype=F64)
    target = torch.zeros((vocab,) * length, dtype=F64)
    for s in itertools.product(range(vocab), repeat=length):
        ctx = (start,) + s
        steps = [float(P[ctx[i], s[i]]) for i in range(length)]
        target[s] = torch.tensor(steps, dtype=F64).prod()
        total = 0.0
        for m in range(1, length + 1):
            if s[:m] in emitted:
                total += emitted[s[:m]] * float(torch.tensor(steps[m:], dtype=F64).prod())
        joint[s] = total
    return joint, target


def total_variation(a: torch.Tensor, b: torch.Tensor) -> float:
    return 0.5 * float((a - b).abs().sum())


def expected_accepted(P, Q, k: int, method: str) -> float:
    total = 0.0
    for x, prob, ctx in _blocks(P, Q, k):
        tau = block_tau_distribution(P, Q, ctx, x)[0] if method == "block" else token_tau_distribution(P, Q, ctx, x)
        total += prob * sum(i * pr for i, pr in enumerate(tau))
    return total


# (vocab, k, seed, top_k): dense and filtered tables (zeros in p and q: w = 0 and all-zero residual paths)
EXACT_CASES = [(3, 1, 0, None), (3, 3, 1, None), (4, 2, 2, None), (4, 3, 3, None), (4, 3, 4, 2), (3, 3, 5, 2)]


def per_token_weights(p_x: torch.Tensor, q_x: torch.Tensor) -> torch.Tensor:
    """The mutant: each position's weight min(1, p/q) on its own, not carried from the previous position."""
    return torch.where(p_x >= q_x, 1.0, p_x / q_x)


@pytest.mark.parametrize(("vocab", "k", "seed", "top_k"), EXACT_CASES)
def test_block_verification_is_exactly_lossless(vocab, k, seed, top_k):
    P, Q = markov_pair(vocab, seed, top_k=top_k)
    emitted = emitted_distribution(P, Q, k)
    assert abs(sum(emitted.values()) - 1.0) < 1e-12
    joint, target = extended_joint(P, emitted, k + 1)
    assert float((joint - target).abs().max()) < 1e-12, f"TV {total_variation(joint, target):.3g}"


@pytest.mark.parametrize(("vocab", "k", "seed", "top_k"), [c for c in EXACT_CASES if c[1] >= 2])
def test_per_token_mutant_is_rejected_exactly(vocab, k, seed, top_k, monkeypatch):
    """The same check fails when the weights are not carried (k = 1 is excluded: there the two coincide)."""
    monkeypatch.setattr(bv, "block_weights", per_token_weights)
    P, Q = markov_pair(vocab, seed, top_k=top_k)
    joint, target = extended_joint(P, emitted_distribution(P, Q, k), k + 1)
    assert total_variation(joint, target) > 1e-3, "the per-token mutant passed the exact test"


def test_token_wise_enumeration_is_lossless_too():
    """The token-wise enumeration used for the comparisons below is itself a valid verifier (a check on it)."""
    P, Q = markov_pair(4, 3)
    joint, target = extended_joint(P, emitted_distribution(P, Q, 3, method="token"), 4)
    assert float((joint - target).abs().max()) < 1e-12


def test_block_accepts_at_least_as_many_as_token_wise():
    """Exact expected accepted drafts on 24 random pairs, k = 1..4: block >= token always (= at k = 1), and > for
    most pairs at k >= 2 (the theorem's inequality, and that it is not trivially an equality)."""
    strictly_better, gains = 0, []
    for seed in range(24):
        vocab = 3 + seed % 2
        P, Q = markov_pair(vocab, 100 + seed, noise=0.5 + 0.1 * (seed % 10))
        for k in range(1, 5):
            block, token = expected_accepted(P, Q, k, "block"), expected_accepted(P, Q, k, "token")
            assert block >= token - 1e-12, f"seed {seed} k={k}: block {block:.6f} < token {token:.6f}"
            if k == 1:
                assert abs(block - token) < 1e-12, "with one draft the two rules are the same"
            elif block > token + 1e-9:
                strictly_better += 1
                gains.append(block / token)
    assert strictly_better >= 48, f"block beat token-wise in only {strictly_better} of 72 cases with k >= 2"
    print(f"\nblock / token expected accepted drafts, k >= 2: min {min(gains):.4f}, max {max(gains):.4f}")


def test_onehot_drafts_gain_nothing_from_block_verification():
    """A deterministic drafter (q one-hot at its guess): block verification emits exactly token-wise's
    distribution, which is why ``draft_is_onehot`` rows fall back to the token-wise rule."""
    P, _ = markov_pair(4, 7)
    guess = torch.tensor([1, 0, 3, 3, 2])  # the drafter's guess after each context (row 4 = start)
    Q = torch.nn.functional.one_hot(guess, 4).to(F64)
    for k in (2, 3):
        block, token = emitted_distribution(P, Q, k, "block"), emitted_distribution(P, Q, k, "token")
        assert block.keys() == token.keys()
        assert max(abs(block[e] - token[e]) for e in block) < 1e-12


# --- Monte Carlo through the reference --------------------------------------------------------------------------
ROWS_PER_GROUP = 50_000
LENGTH = 3  # tokens per request: a 3-token joint over VOCAB = 8 (filtered: most cells have p = 0)
GROUPS = (("model", 2), ("model", 3), ("one-hot", 3))  # (drafter, k)
ALPHA = 1e-6


def run_round(model, prev, seeds, positions, k: int, onehot: bool, drafts_by_position: bool = False):
    """One block-verification round with k drafts per row (every row an independent request); ``positions``: the
    first draft's position. Draft j's noise is keyed by (round start, j) - ``round_stream``, as the engine's draft
    model draws under verify="block" - so that every round draws fresh drafts; ``drafts_by_position`` keys it by
    the draft's own position instead (the token-wise keying), a mutant."""
    rows = prev.shape[0]
    contexts = [prev]
    for j in range(k):
        if onehot:
            draft = model["ngram"][contexts[-1]]
        else:
            # inverse CDF with one uniform per row, as the engine's draft model samples (sample_from_probs)
            if drafts_by_position:
                draft = sample_inverse_cdf(model["Q"][contexts[-1]], seeds, positions + j, STREAM_DRAFT)
            else:
                draft = sample_inverse_cdf(model["Q"][contexts[-1]], seeds, positions, round_stream(STREAM_DRAFT, j))
        contexts.append(draft)
    ctx = torch.stack(contexts, dim=1)  # (R, k + 1)
    cu = torch.arange(rows + 1, dtype=torch.int32) * k
    return block_verify_reference(
        draft_token_ids=ctx[:, 1:].flatten(), cu_num_draft_tokens=cu,
        draft_probs=None if onehot else model["Q"][ctx[:, :k]].reshape(rows * k, VOCAB),
        target_probs=model["P"][ctx].reshape(rows * (k + 1), VOCAB),
        target_argmax=model["target_argmax"][ctx].flatten(), is_greedy=torch.zeros(rows, dtype=torch.bool),
        draft_is_onehot=torch.full((rows,), onehot), seeds=seeds, positions=positions, max_num_draft_tokens=k,
    )  # fmt: skip


def decode(model, k: int, onehot: bool, rows: int = ROWS_PER_GROUP, seed: int = 4321, drafts_by_position=False):
    """(the first LENGTH tokens [R, LENGTH], the first round's accepted counts [R]) of ``rows`` requests."""
    gen = torch.Generator().manual_seed(seed)
    seeds = torch.randint(-(2**62), 2**62, (rows,), generator=gen)
    base = torch.randint(0, 1 << 20, (rows,), generator=gen)
    tokens = torch.full((rows, LENGTH), -1)
    count = torch.zeros(rows, dtype=torch.int64)
    prev = torch.full((rows,), START)
    first_accepted = None
    while bool((count < LENGTH).any()):
        act = (count < LENGTH).nonzero().squeeze(1)
        out, acc = run_round(model, prev[act], seeds[act], base[act] + count[act], k, onehot, drafts_by_position)
        acc = acc.long()
        first_accepted = acc if first_accepted is None else first_accepted
        for c in range(k + 1):
            pos = count[act] + c
            keep = (c <= acc) & (pos < LENGTH)
            tokens[act[keep], pos[keep]] = out[keep, c]
        prev[act] = out.gather(1, acc[:, None]).squeeze(1)
        count[act] += acc + 1
    return tokens, first_accepted


def chi_square_tables(model, groups=GROUPS, **kwargs) -> list[tuple[str, float, float]]:
    """(group, statistic, Bonferroni bound) of every group's 3-token joint against the target's."""
    P = model["P"].double()
    target = P[START][:, None, None] * P[:VOCAB][:, :, None] * P[:VOCAB][None, :, :]  # (V, V, V)
    results = []
    for name, k in groups:
        tokens, _ = decode(model, k, name == "one-hot", **kwargs)
        cells = (tokens[:, 0] * VOCAB + tokens[:, 1]) * VOCAB + tokens[:, 2]
        stat, df = chi_square(torch.bincount(cells, minlength=VOCAB**3), target)
        results.append((f"{name} k={k}", stat, chi2_isf(ALPHA / len(groups), df)))
    return results


def _format(results) -> str:
    return "\n".join(f"  {name:12s} chi2={stat:10.1f}  bound={bound:6.1f}" for name, stat, bound in results)


@pytest.fixture(scope="module")
def model():
    return make_model()


def test_reference_output_follows_target(model):
    results = chi_square_tables(model)
    print("\n" + _format(results))
    assert all(stat <= bound for _, stat, bound in results), "block verification output is not p:\n" + (
        _format(results))
    _, accepted = decode(model, 3, False)
    assert (accepted == 0).any() and (accepted == 3).any() and ((accepted > 0) & (accepted < 3)).any()


def position_keyed_uniforms(seeds: torch.Tensor, positions: torch.Tensor, k: int) -> torch.Tensor:
    """The second mutant: eta_i keyed by draft i's own position (as spec_sample keys its accept uniforms)."""
    j = torch.arange(k)
    return philox_uniform(seeds[:, None], positions[:, None] + j, STREAM_BLOCK_ACCEPT, torch.zeros_like(j))


@pytest.mark.parametrize("mutant", ["per_token_weights", "position_keyed_uniforms"])
def test_reference_mutants_are_rejected(model, mutant, monkeypatch):
    if mutant == "per_token_weights":
        monkeypatch.setattr(bv, "block_weights", per_token_weights)
    else:
        monkeypatch.setattr(bv, "block_uniforms", position_keyed_uniforms)
    results = chi_square_tables(model)
    print(f"\n{mutant}:\n" + _format(results))
    assert any(stat > bound for _, stat, bound in results), f"mutant {mutant} passed:\n" + _format(results)


@pytest.mark.parametrize("drafts_by_position", [False, True], ids=["fresh-per-round", "keyed-by-position"])
def test_drafts_must_be_fresh_per_round(model, drafts_by_position):
    """Why the draft model keys its noise by round under verify="block" (DraftModelProposer.noise_per_round): the
    same test passes with drafts drawn fresh every round and rejects drafts keyed by their own position, which
    the next round redraws with noise this round's decision looked at. 100,000 requests at k = 4."""
    results = chi_square_tables(model, groups=(("model", 4),), rows=100_000, drafts_by_position=drafts_by_position)
    print("\n" + _format(results))
    rejected = any(stat > bound for _, stat, bound in results)
    assert rejected == drafts_by_position, _format(results)
