"""End-to-end proof that speculative sampling with RECYCLED-CANDIDATE trees (method "recycle") is lossless.

The drafter's trees are one-hot (a node's children: the target's top-W ids after the node's token, recorded at
earlier forwards; distinct, with q a point mass), and its matrix is shared by every request of the engine, so a
request's drafts depend on what other requests' forwards ranked - never on its own future draws. Verification
(``ops.tree_sample``) must then give exactly the target's distribution: the real engine against the exact oracle
of ``tests/oracle.py`` (vocabulary-4 models, float64 joint of m tokens, pooled chi-square at 1e-6).

Planted mutant: a rejected one-hot sibling is not removed from the residual (``reject_sibling`` leaves the excluded
tokens as they were), so after a rejection the draft can be drawn again - the joint must then fail the test.
"""

from __future__ import annotations

import pytest
from helpers import small_llm
from oracle import CONFIGS, N_MUTANT, PROMPT, N, check, exact_joint, run, target_prefix_logits

import specdec
from specdec.kernels import tree_sample as tree_sample_module

# (name, config, depth): m = depth + 2 tokens per request
CASES = [("temperature_1", "temperature_1", 2), ("top_k_top_p", "top_k_top_p", 2), ("penalties", "penalties", 2)]
MAX_M = max(depth for *_, depth in CASES) + 2


@pytest.fixture(scope="module")
def prefix_logits(model_dirs):
    return target_prefix_logits(model_dirs[0], PROMPT, MAX_M)


def recycle_llm(model_dirs, depth):
    spec = specdec.SpeculativeConfig(method="recycle", num_speculative_tokens=depth, tree_policy="always",
                                     tree_budget=5, tree_max_branch=3, tree_max_batch_size=256)
    return small_llm(model_dirs[0], dtype="float32", max_model_len=32, block_size=4, max_num_seqs=256,
                     kv_cache_memory_gb=0.05, enable_prefix_caching=False, speculative=spec)


@pytest.mark.parametrize("name,case,depth", CASES, ids=[c[0] for c in CASES])
def test_recycle_sampling_matches_exact_joint(model_dirs, prefix_logits, name, case, depth):
    cfg, m = CONFIGS[case], depth + 2
    llm = recycle_llm(model_dirs, depth)
    counts, metrics = run(llm, cfg, m, N, f"recycle {name}")
    stat, bound = check(f"recycle {name}", counts, exact_joint(prefix_logits, cfg, m))
    assert stat < bound, f"recycle {name}: not lossless (chi-square {stat:.1f} >= {bound:.1f})"
    accepted = sum(x["accepted"] for x in metrics)
    drafted = sum(x["drafted"] for x in metrics)
    full = sum(x["accepted"] >= depth for x in metrics)
    assert 0 < accepted < drafted and full > N // 20  # rejections and full-depth acceptances both happened
    assert (llm.engine.speculative.proposer.shared.rows >= 0).any()  # the matrix was filled by the step


def test_rejected_sibling_kept_in_the_residual_is_rejected(model_dirs, prefix_logits, monkeypatch):
    """Mutant: after a one-hot rejection the rejected token stays in the residual."""
    monkeypatch.setattr(tree_sample_module, "reject_sibling",
                        lambda scale, excluded, token, step, onehot: (scale, excluded))
    name, case, depth = CASES[0]
    cfg, m = CONFIGS[case], depth + 2
    counts, _ = run(recycle_llm(model_dirs, depth), cfg, m, N_MUTANT, f"mutant recycle {name}")
    stat, bound = check(f"mutant recycle {name}", counts, exact_joint(prefix_logits, cfg, m))
    assert stat > bound, f"the mutant passed (chi-square {stat:.1f} < {bound:.1f}): the test has no power"
