"""End-to-end proof that a reduced draft vocabulary keeps speculative SAMPLING lossless: the real engine with a draft
whose LM head covers 3 of the 4 target ids (``SpeculativeConfig(draft_vocab=)``) against the exact float64 oracle of
``tests/oracle.py`` (same tiny models, same pooled chi-square at 1e-6, deterministic per seed).

The id left out (1) is in the prompt, so the penalty case maps a context holding an id the draft has no logit for;
the target must still emit it, through the residual or the bonus token, at its exact probability. Chains and a
static tree are checked.

Planted mutants must push the statistic over the same bound:
  (a) the column -> target id map off by one (drafts mapped to the neighbouring id, q laid out correctly);
  (b) q renormalised to put mass on the id outside the subset, while drafts are still drawn from the true q.
"""

from __future__ import annotations

import json

import pytest
import torch
from helpers import small_llm
from oracle import CONFIGS, N_MUTANT, PROMPT, VOCAB, N, check, exact_joint, run, target_prefix_logits

import specdec
from specdec.spec_decode.proposers import chain_drafting as chain_drafting_module
from specdec.spec_decode.proposers.draft_vocab import DraftVocab
from specdec.spec_decode.round import SpeculativeRound

SUBSET = [0, 2, 3]  # id 1 is left out of the draft's head
OUTSIDE = 1
# (name, config, tree, k / depth): m = k + 2 tokens per request
CASES = [
    ("chain_top_k_top_p", "top_k_top_p", None, 2),
    ("chain_penalties", "penalties", None, 2),
    ("tree_3_1", "temperature_1", [3, 1], 2),
]
MUTANT_CASE = CASES[0]
MAX_M = max(k for *_, k in CASES) + 2


@pytest.fixture(scope="module")
def prefix_logits(model_dirs):
    return target_prefix_logits(model_dirs[0], PROMPT, MAX_M)


@pytest.fixture(scope="module")
def subset_file(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("subset") / "subset.json"
    path.write_text(json.dumps(SUBSET))
    return str(path)


def reduced_llm(model_dirs, subset_file: str, tree, k: int) -> specdec.LLM:
    target, draft = model_dirs
    shape = {} if tree is None else {"tree": tree, "tree_policy": "always", "tree_max_batch_size": 256}
    spec = specdec.SpeculativeConfig(draft_model=draft, num_speculative_tokens=k, draft_vocab=subset_file, **shape)
    return small_llm(target, dtype="float32", max_model_len=32, block_size=4, max_num_seqs=256,
                       kv_cache_memory_gb=0.05, enable_prefix_caching=False, speculative=spec)


@pytest.mark.parametrize("name,case,tree,k", CASES, ids=[c[0] for c in CASES])
def test_reduced_vocab_sampling_matches_exact_joint(model_dirs, prefix_logits, subset_file, name, case, tree,
                                                    k):
    cfg, m = CONFIGS[case], k + 2
    llm = reduced_llm(model_dirs, subset_file, tree, k)
    assert llm.engine.speculative.proposer.runner.model.lm_head.out_features == len(SUBSET)
    counts, metrics = run(llm, cfg, m, N, name)
    stat, bound = check(name, counts, exact_joint(prefix_logits, cfg, m))
    assert stat < bound, f"{name}: a reduced draft vocabulary is not lossless (chi-square {stat:.1f} >= {bound:.1f})"
    accepted = sum(x["accepted"] for x in metrics)
    drafted = sum(x["drafted"] for x in metrics)
    assert 0.2 * drafted < accepted < drafted  # acceptances and rejections both happened
    # the id the draft cannot propose is still emitted at the verified positions (1..m-1), by the residual or bonus
    emitted_outside = sum(int(counts.select(t, OUTSIDE).sum()) for t in range(1, m))
    assert emitted_outside > N // 20


def plant_off_by_one_map(monkeypatch):
    """(a) drafted columns mapped to the next column's target id; q still laid out at the right ids."""
    monkeypatch.setattr(DraftVocab, "to_target", lambda self, columns: self.target_ids[(columns + 1) % self.size])


def plant_mass_outside(monkeypatch):
    """(b) the q verification sees has 30% of its mass moved onto the id outside the subset."""
    real = chain_drafting_module.q_over_target

    def q_over_target(probs, vocab, target_vocab_size):
        q = real(probs, vocab, target_vocab_size).clone()
        q *= 0.7
        q[:, OUTSIDE] += 0.3 * q.sum(dim=1) / 0.7
        return q / q.sum(dim=1, keepdim=True)

    monkeypatch.setattr(chain_drafting_module, "q_over_target", q_over_target)


MUTANTS = {"off_by_one_map": plant_off_by_one_map, "mass_outside_the_subset": plant_mass_outside}


@pytest.mark.parametrize("mutant", list(MUTANTS))
def test_planted_mutant_is_rejected(model_dirs, prefix_logits, subset_file, monkeypatch, mutant):
    name, case, tree, k = MUTANT_CASE
    cfg, m, label = CONFIGS[case], k + 2, f"mutant {mutant} ({name})"
    llm = reduced_llm(model_dirs, subset_file, tree, k)
    MUTANTS[mutant](monkeypatch)
    counts, _ = run(llm, cfg, m, N_MUTANT, label)
    stat, bound = check(label, counts, exact_joint(prefix_logits, cfg, m))
    assert stat > bound, f"{label} was not detected (chi-square {stat:.1f} <= {bound:.1f})"


def test_q_sent_to_verification_is_zero_outside_the_subset(model_dirs, subset_file, monkeypatch):
    """The q rows verification reads put exactly 0 on the id outside the subset (chains and trees)."""
    for tree in (None, [3, 1]):
        llm = reduced_llm(model_dirs, subset_file, tree, 2)
        verify = SpeculativeRound.verify
        seen = []

        def spy(self, logits, out, verify=verify, seen=seen):
            seen.append(self.meta.draft_probs.clone())
            return verify(self, logits, out)

        monkeypatch.setattr(SpeculativeRound, "verify", spy)
        run(llm, CONFIGS["temperature_1"], 4, 64, f"q rows tree={tree}")
        q = torch.cat(seen)
        assert q.shape[1] == VOCAB and bool((q[:, OUTSIDE] == 0).all()) and float(q.sum()) > 0
