"""End-to-end proof that speculative sampling with an EAGLE-3 head is lossless: the real engine (the target's hidden
states captured and handed to the head, the head's paged cache, chains and trees, q over the draft vocabulary mapped
back to the target's through d2t) against the exact oracle of ``tests/oracle.py`` (the same vocabulary-4
target, float64 oracle and pooled chi-square at alpha 1e-6).

The head's draft vocabulary is 3 of the target's 4 ids ({0, 2, 3}: d2t = [0, 1, 1]), so q is zero on target id 1:
the head never drafts it and the target still emits it (through the residual or the bonus token). Every request
generates m = depth + 2 tokens from one prompt with its own seed: the first plain, then a drafted and verified
round (k = 1: the round's draft and its bonus token; k = 2: two drafts), verified token-wise, as a block, or as a
tree (static and dynamic).

Planted mutant: the head's drafts are drawn from a q biased towards one token while verification is told the
unbiased q - the joint must then fail the test.
"""

from __future__ import annotations

import pytest
import torch
from helpers import small_llm
from oracle import CONFIGS, PROMPT, N, check, exact_joint, run, target_prefix_logits
from tiny_models import make_tiny_eagle3_head

import specdec
from specdec.spec_decode.proposers import chain_drafting as chain_drafting_module

DRAFT_IDS = [0, 2, 3]
# (name, config, tree, depth, verify): m = depth + 2 tokens per request
CASES = [
    ("chain_k1", "temperature_1", None, 1, "token"),
    ("chain_k2_topk_topp", "top_k_top_p", None, 2, "token"),
    ("chain_k2_block", "temperature_1", None, 2, "block"),
    ("static_tree_2_1", "temperature_1", [2, 1], 2, "token"),
    ("dynamic_tree_penalties", "penalties", "dynamic", 2, "token"),
]
MAX_M = max(case[3] for case in CASES) + 2


@pytest.fixture(scope="module")
def head_dir(model_dirs, tmp_path_factory):
    path = str(tmp_path_factory.mktemp("lossless_head"))
    # the one-layer target: the embeddings, and its layer's output twice (ids 0..1 are all it has)
    make_tiny_eagle3_head(path, model_dirs[0], seed=9, draft_ids=DRAFT_IDS, aux_layer_ids=[0, 1, 1],
                          structured=False, num_heads=4, intermediate_size=48)
    return path


@pytest.fixture(scope="module")
def eagle_prefix_logits(model_dirs):
    return target_prefix_logits(model_dirs[0], PROMPT, MAX_M)


def eagle_llm(target, head, tree, depth, verify="token"):
    spec = specdec.SpeculativeConfig(method="eagle3", draft_model=head, num_speculative_tokens=depth,
                                     tree_policy="always", tree=tree, tree_budget=4, tree_max_branch=2,
                                     tree_max_batch_size=256, verify=verify)
    return small_llm(target, dtype="float32", max_model_len=32, block_size=4, max_num_seqs=256,
                       kv_cache_memory_gb=0.02, speculative=spec)


@pytest.mark.parametrize("name,case,tree,depth,verify", CASES, ids=[c[0] for c in CASES])
def test_eagle3_sampling_matches_exact_joint(model_dirs, head_dir, eagle_prefix_logits, name, case, tree, depth,
                                             verify):
    cfg, m = CONFIGS[case], depth + 2
    llm = eagle_llm(model_dirs[0], head_dir, tree, depth, verify)
    counts, metrics = run(llm, cfg, m, N, name)
    stat, bound = check(name, counts, exact_joint(eagle_prefix_logits, cfg, m))
    assert stat < bound, f"{name}: EAGLE-3 speculative sampling is not lossless (chi-square {stat:.1f} >= {bound:.1f})"
    drafted = sum(x["drafted"] for x in metrics)
    accepted = sum(x["accepted"] for x in metrics)
    rejected = sum(x["accepted"] < x["drafted"] for x in metrics)
    full = sum(x["num_rounds"] >= 1 and x["accepted"] >= depth for x in metrics)
    print(f"\n[{name}] acceptance {accepted / drafted:.2f}, requests with a rejection {rejected}, with a full-depth "
          f"round {full}", end="")
    assert rejected > N // 20 and full > N // 20  # both branches of verification ran
    assert 1 in counts.nonzero()[:, 1:].flatten().tolist()  # the target emitted the id the head cannot draft


def test_biased_drafts_are_rejected(model_dirs, head_dir, eagle_prefix_logits, monkeypatch):
    """Mutant: drafts drawn from the head's logits + 4 on target id 0, verification told the unbiased q."""
    real = chain_drafting_module.sample_rows

    def biased(logits, params, *args, **kwargs):
        _, probs = real(logits, params, *args, **kwargs)
        tokens, _ = real(logits + 4.0 * (torch.arange(logits.shape[-1]) == 0), params, *args,
                         **{**kwargs, "bad_rows": []})
        return tokens, probs

    monkeypatch.setattr(chain_drafting_module, "sample_rows", biased)
    name, case, tree, depth, _ = CASES[1]
    cfg, m = CONFIGS[case], depth + 2
    counts, _ = run(eagle_llm(model_dirs[0], head_dir, tree, depth), cfg, m, N, f"mutant {name}")
    stat, bound = check(f"mutant {name}", counts, exact_joint(eagle_prefix_logits, cfg, m))
    assert stat > bound, f"the biased-draft mutant passed (chi-square {stat:.1f} < {bound:.1f}): the test has no power"
