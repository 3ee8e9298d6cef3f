"""Losslessness of tree verification: an exact enumerated oracle, and a Monte-Carlo test of the implementation.

Model: a tiny context-dependent "language model" over a vocabulary of 4. ``P[ctx]`` (target, some contexts with a
token filtered out: p = 0 there) and ``Q[ctx]`` (draft, full support) for every context of length <= 5 (two rounds
of depth-2 trees); a one-hot drafter proposes ``GUESS[ctx]``, a fixed order of all tokens (so its children may lie
outside p's support). A single round starts at the empty context (the root) and its output is continued with the
target up to ``depth + 1`` tokens; lossless means the joint of those tokens is prod_i P[t_<i](t_i).

1. Exact: ``oracle_round`` enumerates every draw of the tree (children drawn without replacement from Q, each
   ordered draw with its probability, or the one-hot guesses) and every accept/reject outcome of the algorithm with
   its probability, in float64, independently of the implementation (the math of the issue, written plainly: p_k,
   q_k, norm(max(p_k - q_k, 0))). The joint must equal the target's to 1e-12.
2. Monte-Carlo: ``tree_sample_reference`` on N requests, each with its own seed, whose trees are drawn the way a
   drafter draws them (Gumbel-top-k over Philox STREAM_DRAFT noise, shared by all nodes of a depth); the emitted
   tokens are continued with torch's sampler. Pearson's chi-square against the exact target joint, cells with
   expected count < 20 pooled, bound at alpha = 1e-6 split over the tables of the test (Bonferroni). Every run is
   seeded, so it always passes or always fails. The kernel is checked token for token against the reference on
   the first requests of the correct depth-2 runs (so the statistics carry over to it).
3. Two rounds: the second round starts right after the first's tokens (drafts and uniforms keyed by depth from
   its own start), and the first 4 tokens must follow the target: no draw that decided round 1 is reused by
   round 2 (``docs/kernels.md``, "Tree verification", randomness). A second round starting one position early (an
   engine off-by-one that reuses round 1's last draws) must be rejected by the same chi-square.

Planted mutants, each rejected by the same check as the correct algorithm passes (exact and Monte-Carlo):
  (a) the residual not updated between siblings (sampled children);
  (b) q_k not renormalised after removing the earlier siblings (sampled children);
  (c) the residual keeping a rejected one-hot child's mass (one-hot children).
"""

from __future__ import annotations

import itertools
import math
from collections import defaultdict

import pytest
import torch
from stats_helpers import chi2_isf

from specdec.kernels import tree_sample as tree_sample_module
from specdec.kernels.philox import STREAM_DRAFT, row_exponentials
from specdec.kernels.tree_sample import tree_sample, tree_sample_reference

VOCAB = 4
MAX_CTX = 5  # two rounds of depth-2 trees: a round-2 node sees up to 3 + 2 tokens
# Tree shapes as nested lists: a node is the list of its children's shapes (siblings in drawing order).
SHAPES = {
    "root-3-children": [[], [], []],
    "depth-2-branching": [[[], []], [[]]],
    "depth-2-wide": [[[], [], []], [[], []], []],
}
MC_SHAPES = ("root-3-children", "depth-2-branching")
EXACT_TOL = 1e-12
N_MC = 24_000
N_MUTANT = 12_000
N_KERNEL = 30  # requests of the correct depth-2 Monte-Carlo runs replayed through the kernel (interpreter)
ALPHA = 1e-6
MIN_EXPECTED = 20.0


# --- the model ---------------------------------------------------------------------------------------------------
def contexts() -> list[tuple[int, ...]]:
    return [c for n in range(MAX_CTX + 1) for c in itertools.product(range(VOCAB), repeat=n)]


def make_model(seed: int = 0) -> dict:
    """float64 tables keyed by context: P (target, some tokens filtered), Q (draft), GUESS (one-hot drafter)."""
    gen = torch.Generator().manual_seed(seed)
    ctxs = contexts()
    logits = 1.2 * torch.randn(len(ctxs), VOCAB, generator=gen, dtype=torch.float64)
    p = torch.softmax(logits, -1)
    filtered = torch.rand(len(ctxs), generator=gen) < 0.4  # drop the least likely token there (p = 0)
    p[filtered, p[filtered].argmin(-1)] = 0.0
    p = p / p.sum(-1, keepdim=True)
    q = torch.softmax(logits + 2.0 * torch.randn(len(ctxs), VOCAB, generator=gen, dtype=torch.float64), -1)
    guess = torch.randn(len(ctxs), VOCAB, generator=gen).argsort(-1, descending=True)
    index = {c: i for i, c in enumerate(ctxs)}
    child_rows = torch.full((len(ctxs), VOCAB), -1, dtype=torch.int64)  # row of ctx + (t,) (-1: too long)
    for c, i in index.items():
        if len(c) < MAX_CTX:
            child_rows[i] = torch.tensor([index[c + (t,)] for t in range(VOCAB)])
    return {
        "P": {c: p[i].tolist() for i, c in enumerate(ctxs)},
        "Q": {c: q[i].tolist() for i, c in enumerate(ctxs)},
        "GUESS": {c: guess[i].tolist() for i, c in enumerate(ctxs)},
        "index": index,
        "child_rows": child_rows,
        "P_rows": p.float(),
        "Q_rows": q.float(),
        "GUESS_rows": guess,
    }


def depth_of(shape) -> int:
    return 1 + max((depth_of(child) for child in shape), default=-1) if shape else 0


# --- 1. the exact oracle -----------------------------------------------------------------------------------------
def child_draws(model, ctx, num_children: int, kind: str, renormalise: bool = True):
    """Every draw of a node's children: (tokens, probability, q_k per child). Sampled children are drawn without
    replacement from Q[ctx], so q_k is Q[ctx] with the earlier siblings removed and renormalised; one-hot children
    are the first guesses, q_k = onehot."""
    if kind == "onehot":
        tokens = tuple(model["GUESS"][ctx][:num_children])
        yield tokens, 1.0, [[float(v == x) for v in range(VOCAB)] for x in tokens]
        return
    q = model["Q"][ctx]
    for tokens in itertools.permutations(range(VOCAB), num_children):
        prob, q_ks = 1.0, []
        for k, x in enumerate(tokens):
            q_k = [0.0 if v in tokens[:k] else q[v] for v in range(VOCAB)]
            total = sum(q_k)
            q_k = [v / total for v in q_k]
            prob *= q_k[x]
            q_ks.append(q_k if renormalise else q)  # mutant (b): the verifier is handed q, not q_k
        yield tokens, prob, q_ks


def oracle_round(model, ctx, shape, kind: str, mutant: str | None = None) -> dict[tuple[int, ...], float]:
    """Exact distribution of the tokens one verification round emits from the node at ``ctx`` with children
    ``shape``, enumerating every draw and every accept/reject outcome."""
    p = model["P"][ctx]
    emitted: dict[tuple[int, ...], float] = defaultdict(float)
    if not shape:
        for t in range(VOCAB):
            emitted[(t,)] += p[t]
        return emitted
    renormalise = mutant != "q_not_renormalised"
    for tokens, draw_prob, q_ks in child_draws(model, ctx, len(shape), kind, renormalise):
        p_k, reach = p, draw_prob
        for k, (x, q_k) in enumerate(zip(tokens, q_ks)):
            accept = min(1.0, p_k[x] / q_k[x]) if q_k[x] > 0 else 1.0
            for tail, prob in oracle_round(model, ctx + (x,), shape[k], kind, mutant).items():
                emitted[(x, *tail)] += reach * accept * prob
            reach *= 1.0 - accept
            if reach == 0.0:
                break
            if mutant != "residual_not_updated":  # mutants (a) and (c): p_{k+1} = p_k
                residual = [max(a - b, 0.0) for a, b in zip(p_k, q_k)]
                p_k = [r / sum(residual) for r in residual]
        else:
            for t in range(VOCAB):
                emitted[(t,)] += reach * p_k[t]
    return emitted


def extend_with_target(model, emitted: dict, length: int) -> dict[tuple[int, ...], float]:
    """The joint of ``length`` tokens when each emitted prefix is continued by sampling the target."""
    joint: dict[tuple[int, ...], float] = defaultdict(float)
    for prefix, prob in emitted.items():
        for tail in itertools.product(range(VOCAB), repeat=length - len(prefix)):
            seq, pr = prefix + tail, prob
            for i in range(len(prefix), length):
                pr *= model["P"][seq[:i]][seq[i]]
            joint[seq] += pr
    return joint


def target_joint(model, length: int) -> dict[tuple[int, ...], float]:
    return extend_with_target(model, {(): 1.0}, length)


def max_joint_error(model, shape, kind: str, mutant: str | None = None) -> float:
    length = depth_of(shape) + 1
    joint = extend_with_target(model, oracle_round(model, (), shape, kind, mutant), length)
    target = target_joint(model, length)
    return max(abs(joint.get(seq, 0.0) - target[seq]) for seq in target)


@pytest.fixture(scope="module")
def model():
    m = make_model()
    assert any(0.0 in row for row in m["P"].values()), "p must have zeros for the support to matter"
    return m


@pytest.mark.parametrize("kind", ["sampled", "onehot"])
@pytest.mark.parametrize("shape", list(SHAPES))
def test_exact_joint_equals_target(model, shape, kind):
    error = max_joint_error(model, SHAPES[shape], kind)
    assert error <= EXACT_TOL, f"{shape} {kind}: the round's joint differs from the target's by {error:.3g}"


@pytest.mark.parametrize(("mutant", "kind"), [("residual_not_updated", "sampled"), ("q_not_renormalised", "sampled"),
                                              ("residual_not_updated", "onehot")])  # fmt: skip
def test_exact_check_rejects_planted_mutants(model, mutant, kind):
    for shape in SHAPES:
        error = max_joint_error(model, SHAPES[shape], kind, mutant)
        print(f"{mutant} {kind} {shape}: {error:.3g}")
        assert error > 1e-3, f"mutant {mutant} ({kind}) passes the exact check on {shape}: error {error:.3g}"


# --- 2. Monte-Carlo on the implementation ------------------------------------------------------------------------
def flatten_shape(shape) -> list[int]:
    """Parents (local, DFS order, root -1) of a nested shape."""
    parents = [-1]

    def visit(node_shape, index):
        for child in node_shape:
            parents.append(index)
            visit(child, len(parents) - 1)

    visit(shape, 0)
    return parents


def draw_trees(model, parents: list[int], kind: str, seeds, positions, root_ctx):
    """Tokens ``[N, n + 1]`` and context row of each node ``[N, n + 1]`` from the roots' context rows ``root_ctx``
    ``[N]`` and depth-1 positions ``[N]``, drawn like a drafter: a node's children
    are the top-m of Q[ctx] / E (Gumbel-top-k = sampling without replacement), E from Philox STREAM_DRAFT at the
    children's position (shared by all nodes of a depth), or the first m guesses (one-hot)."""
    rows, n = seeds.shape[0], len(parents)
    depths = [0] * n
    for i in range(1, n):
        depths[i] = depths[parents[i]] + 1
    index_of = model["child_rows"]
    tokens = torch.zeros(rows, n, dtype=torch.int64)
    ctx = torch.zeros(rows, n, dtype=torch.int64)
    ctx[:, 0] = root_ctx
    for node in range(n):
        kids = [i for i in range(n) if parents[i] == node]
        if not kids:
            continue
        if kind == "onehot":
            chosen = model["GUESS_rows"][ctx[:, node], : len(kids)]
        else:
            noise = row_exponentials(seeds, positions + depths[node], STREAM_DRAFT, VOCAB)
            chosen = (model["Q_rows"][ctx[:, node]] / noise).topk(len(kids), dim=-1).indices
        for slot, kid in enumerate(kids):
            tokens[:, kid] = chosen[:, slot]
            ctx[:, kid] = index_of[ctx[:, node], chosen[:, slot]]
    return tokens, ctx, index_of


def request_keys(num: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(seeds, first positions) int64 ``[num]`` of independent requests."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(-(2**62), 2**62, (num,), generator=gen), torch.randint(0, 1 << 20, (num,), generator=gen)


def mc_inputs(model, shape, kind: str, seeds, positions, root_ctx=None):
    """tree_sample's inputs for one round of every request (root context () unless ``root_ctx`` rows are given)."""
    parents = flatten_shape(shape)
    num = seeds.shape[0]
    root_ctx = torch.zeros(num, dtype=torch.int64) if root_ctx is None else root_ctx
    tokens, ctx, index_of = draw_trees(model, parents, kind, seeds, positions, root_ctx)
    n = len(parents)
    args = {
        "node_token_ids": tokens.flatten(),
        "node_parents": torch.tensor(parents, dtype=torch.int32).repeat(num),
        "cu_num_nodes": torch.arange(0, (num + 1) * n, n, dtype=torch.int32),
        "draft_probs": None if kind == "onehot" else model["Q_rows"][ctx.flatten()],
        "target_probs": model["P_rows"][ctx.flatten()],
        "target_argmax": model["P_rows"][ctx.flatten()].argmax(-1),
        "is_greedy": torch.zeros(num, dtype=torch.bool),
        "draft_is_onehot": torch.full((num,), kind == "onehot"),
        "seeds": seeds,
        "positions": positions,
        "max_depth": depth_of(shape),
    }
    return args, index_of


def continue_with_target(model, out, emitted, index_of, length: int, seed: int) -> torch.Tensor:
    """Full sequences ``[N, length]``: each request's ``emitted`` first tokens of ``out``, then tokens sampled
    from the target."""
    gen = torch.Generator().manual_seed(seed)
    seqs = out[:, :length].clone()
    ctx = torch.zeros(out.shape[0], dtype=torch.int64)
    for i in range(length):
        fresh = i >= emitted
        draw = torch.multinomial(model["P_rows"][ctx], 1, generator=gen).squeeze(1)
        seqs[:, i] = torch.where(fresh, draw, seqs[:, i])
        if i + 1 < length:
            ctx = index_of[ctx, seqs[:, i]]
    return seqs


def chi_square(counts: torch.Tensor, probs: torch.Tensor) -> tuple[float, int]:
    """(Pearson statistic, degrees of freedom); cells with expected count < MIN_EXPECTED pooled; inf if a cell of
    probability 0 is hit."""
    counts, probs = counts.double(), probs.double()
    if counts[probs == 0].sum() > 0:
        return math.inf, 1
    expected = probs * counts.sum()
    big, small = expected >= MIN_EXPECTED, (expected < MIN_EXPECTED) & (probs > 0)
    obs, exp = counts[big], expected[big]
    if small.any():
        obs, exp = torch.cat([obs, counts[small].sum()[None]]), torch.cat([exp, expected[small].sum()[None]])
    return float(((obs - exp) ** 2 / exp).sum()), max(int(obs.numel()) - 1, 1)


def joint_chi_square(model, seqs: torch.Tensor) -> tuple[float, int]:
    """Chi-square of the sequences ``[N, L]`` against the target's exact joint of L tokens."""
    length = seqs.shape[1]
    cells = (seqs * VOCAB ** torch.arange(length - 1, -1, -1)).sum(-1)
    counts = torch.bincount(cells, minlength=VOCAB**length)
    target = target_joint(model, length)
    probs = torch.tensor([target[seq] for seq in itertools.product(range(VOCAB), repeat=length)])
    return chi_square(counts, probs)


def mc_statistic(model, shape_name: str, kind: str, num: int, seed: int, check_kernel: bool = False):
    """(chi-square, degrees of freedom, fraction of rounds that accepted >= 1 later sibling or rejected all)."""
    shape = SHAPES[shape_name]
    args, index_of = mc_inputs(model, shape, kind, *request_keys(num, seed))
    out, accepted, nodes = tree_sample_reference(**args)
    if check_kernel:
        sub = {**args, "cu_num_nodes": args["cu_num_nodes"][: N_KERNEL + 1],
               **{k: args[k][: N_KERNEL] for k in ("is_greedy", "draft_is_onehot", "seeds", "positions")}}
        n_rows = int(sub["cu_num_nodes"][-1])
        for k in ("node_token_ids", "node_parents", "draft_probs", "target_probs", "target_argmax"):
            if sub[k] is not None:
                sub[k] = sub[k][:n_rows]
        kernel = tree_sample(**sub)
        for name, a, b in zip(("tokens", "accepted", "nodes"), kernel, (out, accepted, nodes)):
            assert torch.equal(a, b[:N_KERNEL]), f"kernel != reference ({name}) on {shape_name} {kind}"
    length = depth_of(shape) + 1
    seqs = continue_with_target(model, out, accepted.long() + 1, index_of, length, seed + 1)
    stat, df = joint_chi_square(model, seqs)
    later = (nodes[:, 0] > 1).float().mean().item()  # the root's accepted child was not its first
    return stat, df, later, (accepted == 0).float().mean().item()


MC_CASES = [(shape, kind) for shape in MC_SHAPES for kind in ("sampled", "onehot")]


@pytest.mark.parametrize(("shape", "kind"), MC_CASES)
def test_monte_carlo_joint_follows_target(model, shape, kind):
    check_kernel = shape == "depth-2-branching"
    stat, df, later, rejected_all = mc_statistic(model, shape, kind, N_MC, seed=7, check_kernel=check_kernel)
    bound = chi2_isf(ALPHA / len(MC_CASES), df)
    print(f"\n{shape} {kind}: chi2={stat:.1f} df={df} bound={bound:.1f} later-sibling={later:.3f} "
          f"rejected-all={rejected_all:.3f}")  # fmt: skip
    assert later > 0.05, "the run must accept later siblings"
    # three one-hot guesses at the root cover p's support there (p = 0 on the fourth token): no full rejection
    covered = kind == "onehot" and shape == "root-3-children"
    assert rejected_all > 0.01 or (covered and rejected_all == 0), "the run must reject every root child at times"
    assert stat <= bound, f"{shape} {kind}: the emitted tokens are not distributed as the target (chi2 {stat:.1f})"


def _keep_residual(scale, excluded, token, step, onehot):
    return scale, excluded


def _unnormalised_mass(q, excluded):
    return torch.ones(q.shape[0], dtype=q.dtype, device=q.device)


MC_MUTANTS = {
    "a-residual-not-updated": ("sampled", "reject_sibling", _keep_residual),
    "b-q-not-renormalised": ("sampled", "remaining_draft_mass", _unnormalised_mass),
    "c-onehot-residual-keeps-child": ("onehot", "reject_sibling", _keep_residual),
}


@pytest.mark.parametrize("mutant", list(MC_MUTANTS))
def test_monte_carlo_rejects_planted_mutants(model, mutant, monkeypatch):
    kind, name, replacement = MC_MUTANTS[mutant]
    monkeypatch.setattr(tree_sample_module, name, replacement)
    results = []
    for shape in MC_SHAPES:
        stat, df, _, _ = mc_statistic(model, shape, kind, N_MUTANT, seed=11)
        results.append((shape, stat, chi2_isf(ALPHA / len(MC_CASES), df)))
    print(f"\n{mutant}: " + ", ".join(f"{s} chi2={stat:.1f} bound={b:.1f}" for s, stat, b in results))
    assert any(stat > bound for _, stat, bound in results), f"mutant {mutant} passed: {results}"


# --- 3. two rounds: no randomness that decided a round is reused by the next -------------------------------------
TWO_ROUND_LENGTH = 4


def two_round_sequences(model, kind: str, num: int, seed: int, next_start: int = 1) -> torch.Tensor:
    """The first TWO_ROUND_LENGTH tokens of every request after two depth-2 tree rounds, continued by the target if
    short. Round 2 starts at round 1's start + num_accepted + ``next_start`` (1: right after round 1's tokens), its
    drafts keyed by depth from its own start, like round 1's."""
    shape = SHAPES["depth-2-branching"]
    seeds, positions = request_keys(num, seed)
    args, index_of = mc_inputs(model, shape, kind, seeds, positions)
    out1, acc1, _ = tree_sample_reference(**args)
    emitted1 = acc1.long() + 1
    ctx = torch.zeros(num, dtype=torch.int64)
    for i in range(out1.shape[1]):  # the context row after round 1's tokens
        ctx = torch.where(i < emitted1, index_of[ctx, out1[:, i].clamp(min=0)], ctx)
    args, _ = mc_inputs(model, shape, kind, seeds, positions + acc1.long() + next_start, root_ctx=ctx)
    out2, acc2, _ = tree_sample_reference(**args)
    both = torch.cat([out1, out2], dim=1)  # round 1's tokens (then -1), round 2's tokens (then -1)
    slot = torch.arange(both.shape[1]).expand_as(both)
    order = torch.where(both >= 0, slot, slot + both.shape[1]).argsort(dim=1)  # the emitted tokens first, in order
    tokens = both.gather(1, order)
    emitted = (emitted1 + acc2.long() + 1).clamp(max=TWO_ROUND_LENGTH)
    return continue_with_target(model, tokens, emitted, index_of, TWO_ROUND_LENGTH, seed + 1)


@pytest.mark.parametrize("kind", ["sampled", "onehot"])
def test_two_rounds_follow_target(model, kind):
    stat, df = joint_chi_square(model, two_round_sequences(model, kind, N_MC, seed=21))
    bound = chi2_isf(ALPHA / 2, df)
    print(f"\ntwo rounds {kind}: chi2={stat:.1f} df={df} bound={bound:.1f}")
    assert stat <= bound, f"two rounds ({kind}): the tokens are not distributed as the target (chi2 {stat:.1f})"


def test_two_rounds_reject_reused_positions(model):
    """Mutant (an engine off-by-one): the second round starts at the first round's last emitted position instead of
    the next one, so its first uniforms and draft noise are the ones that rejected round 1's last children."""
    stat, df = joint_chi_square(model, two_round_sequences(model, "sampled", N_MC, seed=21, next_start=0))
    bound = chi2_isf(ALPHA / 2, df)
    print(f"\nround 2 reusing round 1's last position: chi2={stat:.1f} df={df} bound={bound:.1f}")
    assert stat > bound, f"the reused-position mutant passed (chi2 {stat:.1f} <= {bound:.1f})"
