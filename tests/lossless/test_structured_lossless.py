"""Speculative sampling under a structured-output constraint is lossless: the output has exactly the target's
constrained distribution - chains, trees and block verification - against the exact oracle of tests/oracle.py.

The oracle's tiny pair (a target over VOCAB = 4 tokens and its perturbed draft) gets a 4-token tokenizer ("a".."d",
plus an eos token outside the model's vocabulary) and every request the regex ``[ab][abc][a-d][a-d]``: the allowed
set grows with the position ({a, b}, then {a, b, c}, then all four), so the grammar state after the drafts decides
each window row's mask. The oracle masks the float64 logits of every prefix the same way (masked tokens get
probability 0) before the contract's standardization; every request must emit m = 4 tokens the regex admits.

Planted mutant: the window rows masked by the grammar state of the committed output alone, not advanced along the
drafts (``GrammarState.allowed_along`` repeating its first row). Those masks are stricter than the true ones (the
allowed sets only grow), so every token stays inside the grammar - only the distribution is wrong, and the
statistic must reject it.
"""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
import torch
from oracle import (
    CONFIGS,
    N_MUTANT,
    PROMPT,
    VOCAB,
    N,
    check,
    exact_joint,
    lossless_llm,
    make_lossless_pair,
    memoised,
    target_prefix_logits,
)

import specdec
from specdec import SamplingParams, ops
from specdec.structured.grammar import GrammarState

REGEX = "[ab][abc][a-d][a-d]"
ALLOWED = [{0, 1}, {0, 1, 2}, {0, 1, 2, 3}, {0, 1, 2, 3}]  # by output position: what REGEX admits
M = 4  # tokens per request: the first a plain sample, then drafted and verified ones
CASES = {  # name -> SpeculativeConfig kwargs (the draft folder added)
    "chain-k2": {"num_speculative_tokens": 2},
    "tree-21": {"num_speculative_tokens": 2, "tree": [2, 1], "tree_policy": "always", "tree_budget": 5,
                "tree_max_branch": 3, "tree_max_batch_size": 256},
    "block-k2": {"num_speculative_tokens": 2, "verify": "block"},
}


def letter_tokenizer_json() -> str:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    tok = Tokenizer(models.BPE(vocab={"a": 0, "b": 1, "c": 2, "d": 3}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(["<|eos|>"])  # id 4: beyond the model's vocabulary, so never emitted
    return tok.to_str()


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory):
    target, draft = make_lossless_pair(tmp_path_factory.mktemp("structured_lossless"))
    with open(os.path.join(target, "tokenizer.json"), "w") as f:
        f.write(letter_tokenizer_json())
    with open(os.path.join(target, "tokenizer_config.json"), "w") as f:
        json.dump({"eos_token": "<|eos|>", "add_bos_token": False}, f)
    return target, draft


@pytest.fixture(scope="module")
def prefix_logits(model_dirs):
    return target_prefix_logits(model_dirs[0], PROMPT, M)


@pytest.fixture(scope="module")
def make_llm(model_dirs):
    target, draft = model_dirs
    return memoised(lambda name: lossless_llm(target, specdec.SpeculativeConfig(draft_model=draft, **CASES[name])))


def run_constrained(llm, cfg, n, label) -> tuple[torch.Tensor, list[dict]]:
    params = [SamplingParams(seed=i, max_tokens=M, ignore_eos=True, structured_outputs={"regex": REGEX}, **cfg)
              for i in range(n)]
    outs = llm.generate(prompt_token_ids=[PROMPT] * n, sampling_params=params)
    counts = torch.zeros([VOCAB] * M, dtype=torch.int64)
    for out in outs:
        tokens = out.outputs[0].token_ids
        assert out.error is None and len(tokens) == M, (label, out.error, tokens)
        assert all(t in ALLOWED[i] for i, t in enumerate(tokens)), (label, tokens)
        counts[tuple(tokens)] += 1
    return counts, [out.metrics for out in outs]


@pytest.mark.parametrize("case", list(CASES))
def test_constrained_speculative_sampling_matches_exact_joint(make_llm, prefix_logits, case, monkeypatch):
    cfg = CONFIGS["temperature_1"]
    tree_rounds = []
    real_tree_sample = ops.tree_sample
    monkeypatch.setattr(ops, "tree_sample", lambda *a, **k: tree_rounds.append(1) or real_tree_sample(*a, **k))
    counts, metrics = run_constrained(make_llm(case), cfg, N, case)
    assert bool(tree_rounds) == case.startswith("tree"), "the tree case must verify trees, the others chains"
    stat, bound = check(case, counts, exact_joint(prefix_logits, cfg, M, allowed=ALLOWED))
    assert stat < bound, f"{case}: constrained speculative sampling is not lossless ({stat:.1f} >= {bound:.1f})"
    drafted = sum(m["drafted"] for m in metrics)
    accepted = sum(m["accepted"] for m in metrics)
    assert 0 < accepted < drafted, "verification must both accept and reject drafts"


def test_window_rows_masked_without_the_drafts_are_rejected(make_llm, prefix_logits, monkeypatch):
    def first_row_only(self, drafts):
        return np.repeat(self.allowed()[None], len(drafts) + 1, axis=0)

    monkeypatch.setattr(GrammarState, "allowed_along", first_row_only)
    cfg = CONFIGS["temperature_1"]
    counts, _ = run_constrained(make_llm("chain-k2"), cfg, N_MUTANT, "mutant")
    stat, bound = check("mutant", counts, exact_joint(prefix_logits, cfg, M, allowed=ALLOWED))
    assert stat > bound, f"the planted mutant passed ({stat:.1f} <= {bound:.1f}): the test cannot fail"
