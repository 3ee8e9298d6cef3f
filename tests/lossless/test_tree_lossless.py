"""End-to-end proof that speculative sampling with draft TREES is lossless: the real engine (draft-model trees
grown with tree attention over the draft's cache, children drawn without replacement, one ragged target forward
with tree masks, ``ops.tree_sample``, compaction of the accepted path in both pools) against the exact oracle of
``tests/oracle.py`` (same tiny vocabulary-4 models, same float64 oracle, same pooled chi-square at 1e-6).

Every request generates m = depth + 2 tokens from one prompt with its own seed. With a vocabulary of 4, a root
with 3 children covers most of the draft's support, so the residual after two or three rejected siblings, the
one-hot fallback and the bonus token are all exercised.

Planted mutant: the draft's children are its top-c tokens (what engines that assume one-hot top-k children do)
while verification is told they were drawn from q without replacement - the joint must then fail the test.
"""

from __future__ import annotations

import pytest
import torch
from helpers import small_llm
from oracle import CONFIGS, N_MUTANT, PROMPT, N, check, exact_joint, run, target_prefix_logits

import specdec
from specdec.spec_decode.proposers import tree_drafting as tree_drafting_module

# (name, config, tree, depth): m = depth + 2 tokens per request
CASES = [
    ("static_3_2", "temperature_1", [3, 2], 2),
    ("static_3_2_topk_topp", "top_k_top_p", [3, 2], 2),
    ("dynamic_penalties", "penalties", "dynamic", 2),
]
MAX_M = max(depth for *_, depth in CASES) + 2


@pytest.fixture(scope="module")
def tree_prefix_logits(model_dirs):
    return target_prefix_logits(model_dirs[0], PROMPT, MAX_M)


def tree_llm(model_dirs, tree, depth):
    target, draft = model_dirs
    spec = specdec.SpeculativeConfig(draft_model=draft, num_speculative_tokens=depth, tree_policy="always", tree=tree,
                                     tree_budget=5, tree_max_branch=3, tree_max_batch_size=256)
    return small_llm(target, dtype="float32", max_model_len=32, block_size=4, max_num_seqs=256,
                       kv_cache_memory_gb=0.05, enable_prefix_caching=False, speculative=spec)


@pytest.mark.parametrize("name,case,tree,depth", CASES, ids=[c[0] for c in CASES])
def test_tree_sampling_matches_exact_joint(model_dirs, tree_prefix_logits, name, case, tree, depth):
    cfg, m = CONFIGS[case], depth + 2
    counts, metrics = run(tree_llm(model_dirs, tree, depth), cfg, m, N, name)
    stat, bound = check(name, counts, exact_joint(tree_prefix_logits, cfg, m))
    assert stat < bound, f"{name}: tree speculative sampling is not lossless (chi-square {stat:.1f} >= {bound:.1f})"
    accepted = sum(x["accepted"] for x in metrics)
    drafted = sum(x["drafted"] for x in metrics)
    full = sum(x["num_rounds"] >= 1 and x["accepted"] >= depth for x in metrics)
    assert 0 < accepted < drafted and full > N // 20  # rejections and full-depth acceptances both happened


def test_top_c_children_claimed_as_sampled_are_rejected(model_dirs, tree_prefix_logits, monkeypatch):
    """Mutant: no noise in the draw (children = top-c of q) while verification assumes draws from q."""
    monkeypatch.setattr(tree_drafting_module, "row_exponentials",
                        lambda seeds, positions, stream, n: torch.ones(seeds.shape[0], n))
    name, case, tree, depth = CASES[0]
    cfg, m = CONFIGS[case], depth + 2
    counts, _ = run(tree_llm(model_dirs, tree, depth), cfg, m, N_MUTANT, f"mutant {name}")
    stat, bound = check(f"mutant {name}", counts, exact_joint(tree_prefix_logits, cfg, m))
    assert stat > bound, f"the top-c mutant passed (chi-square {stat:.1f} < {bound:.1f}): the test has no power"
