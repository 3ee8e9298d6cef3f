"""``SpeculativeConfig(verify="block")`` through the real engine: lossless sampling against the exact oracle of
tests/oracle.py (same tiny V = 4 target and draft, same chi-square and bound), a planted mutant it rejects,
seeded reproducibility (greedy parity: tests/lossless/test_greedy_parity.py), and the configuration / CLI surface."""

from __future__ import annotations

import pytest
import torch
from helpers import small_llm
from oracle import CONFIGS, N_MUTANT, PROMPT, N, check, exact_joint, lossless_llm, memoised, run, target_prefix_logits
from tiny_models import make_tiny_model

from specdec import SamplingParams, SpeculativeConfig, ops
from specdec.cli import build_parser, speculative_config
from specdec.kernels import block_verify as block_verify_module
from specdec.spec_decode import verify as verify_module

CASES = [("penalties", 2), ("top_k_top_p", 3)]
MAX_M = max(k for _, k in CASES) + 2


@pytest.fixture(scope="module")
def prefix_logits(model_dirs):
    return target_prefix_logits(model_dirs[0], PROMPT, MAX_M)


@pytest.fixture(scope="module")
def make_llm(model_dirs):
    """``make_llm(k)``: the speculative LLM with block verification and k drafts per round."""
    target, draft = model_dirs
    return memoised(lambda k: lossless_llm(target, SpeculativeConfig(draft_model=draft, num_speculative_tokens=k,
                                                                     verify="block")))  # fmt: skip


@pytest.fixture
def block_calls(monkeypatch):
    """Counts the sampled rows that went through ``ops.block_verify`` (so a silent fallback to token-wise fails)."""
    calls = {"rows": 0}
    real = verify_module.ops.block_verify

    def spy(*args):
        is_greedy, onehot = args[5], args[6]
        calls["rows"] += int((~is_greedy & ~onehot).sum())
        return real(*args)

    monkeypatch.setattr(verify_module.ops, "block_verify", spy)
    return calls


@pytest.mark.parametrize("case,k", CASES, ids=[f"{case}-k{k}" for case, k in CASES])
def test_block_sampling_matches_exact_joint(make_llm, prefix_logits, block_calls, case, k):
    cfg, m, label = CONFIGS[case], k + 2, f"block {case} k={k}"
    counts, metrics = run(make_llm(k), cfg, m, N, label)
    stat, bound = check(label, counts, exact_joint(prefix_logits, cfg, m))
    assert stat < bound, f"{label}: block verification is not lossless (chi-square {stat:.1f} >= {bound:.1f})"
    assert block_calls["rows"] >= N, "the sampled rows did not go through block verification"
    drafted = sum(x["drafted"] for x in metrics)
    accepted = sum(x["accepted"] for x in metrics)
    rejected = sum(x["accepted"] < x["drafted"] for x in metrics)
    print(f"\n[{label}] acceptance {accepted / drafted:.3f}", end="")
    assert 0.3 < accepted / drafted < 0.95 and rejected > N // 10


def test_per_token_mutant_is_rejected_by_the_engine_test(make_llm, prefix_logits, monkeypatch):
    """Block verification with weights not carried across positions (min(1, p/q) per position) must fail."""
    monkeypatch.setattr(block_verify_module, "block_weights",
                        lambda p_x, q_x: torch.where(p_x >= q_x, 1.0, p_x / q_x))
    case, k = "top_k_top_p", 3
    cfg, m, label = CONFIGS[case], k + 2, f"block mutant per-token weights ({case} k={k})"
    counts, _ = run(make_llm(k), cfg, m, N_MUTANT, label)
    stat, bound = check(label, counts, exact_joint(prefix_logits, cfg, m))
    assert stat > bound, f"{label} was not detected (chi-square {stat:.1f} <= {bound:.1f})"


def test_draft_noise_is_keyed_by_round_only_under_block(model_dirs):
    target, draft = model_dirs
    for verify, per_round in (("block", True), ("token", False)):
        llm = small_llm(target, dtype="float32", max_model_len=32, block_size=4, kv_cache_memory_gb=0.02,
                          speculative=SpeculativeConfig(draft_model=draft, num_speculative_tokens=2, verify=verify))
        assert llm.engine.speculative.proposer.noise_per_round is per_round


GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)


def tiny_prompts(n, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 257, (int(torch.randint(3, 40, (1,), generator=gen)),), generator=gen).tolist()
            for _ in range(n)]


def test_sampled_run_reproduces_whatever_the_batch(tiny_pair):
    """T > 0 with a tiny random draft model: runs, accepts some drafts, and a seeded request gets the same tokens
    alone and batched (randomness is a function of seed, position and stream, keyed by round here)."""
    llm = small_llm(tiny_pair[0], dtype="float32", block_size=4, max_model_len=256,
                      speculative=SpeculativeConfig(draft_model=tiny_pair[1], num_speculative_tokens=3, verify="block"))
    target = tiny_prompts(1, seed=20)[0]
    params = SamplingParams(temperature=0.8, top_p=0.95, max_tokens=16, seed=42, ignore_eos=True)
    others, other_params = tiny_prompts(3, seed=21), SamplingParams(temperature=1.0, max_tokens=9, ignore_eos=True)
    alone = llm.generate(prompt_token_ids=target, sampling_params=params)[0]
    batched = llm.generate(prompt_token_ids=[target] + others, sampling_params=[params] + [other_params] * 3)
    assert batched[0].outputs[0].token_ids == alone.outputs[0].token_ids
    assert len(alone.outputs[0].token_ids) == 16 and 0 < alone.metrics["accepted"] <= alone.metrics["drafted"]


def test_config_and_cli():
    assert SpeculativeConfig(method="prompt_lookup").verify == "token"
    with pytest.raises(ValueError, match="verify 'blocks' is not supported; supported: \\('token', 'block'\\)"):
        SpeculativeConfig(method="prompt_lookup", verify="blocks")
    args = build_parser().parse_args(["generate", "--prompt", "hi", "--speculative-method", "prompt_lookup",
                                      "--verify", "block"])
    assert speculative_config(args).verify == "block"
    with pytest.raises(SystemExit):
        build_parser().parse_args(["generate", "--prompt", "hi", "--verify", "blocks"])


def test_forced_triton_block_generation_equals_the_reference_path(tmp_path, monkeypatch):
    """The kernel inside the engine (interpreter): the same tokens as the reference path, sampled and greedy."""
    target, draft = str(tmp_path / "t"), str(tmp_path / "d")
    small = dict(hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1, intermediate_size=64)
    make_tiny_model(target, "llama", seed=21, **small)
    make_tiny_model(draft, "llama", seed=21, perturb_from=target, perturb_scale=0.2, **small)
    llm = small_llm(target, dtype="float32", block_size=4, max_model_len=64,
                      speculative=SpeculativeConfig(draft_model=draft, num_speculative_tokens=3, verify="block"))
    prompts = [[5, 6, 7, 8, 9], [10, 11, 12]]
    params = [SamplingParams(temperature=0.9, top_k=30, top_p=0.9, max_tokens=4, seed=3, ignore_eos=True),
              SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)]
    reference = [o.outputs[0].token_ids for o in llm.generate(prompt_token_ids=prompts, sampling_params=params)]
    launches = []
    real = block_verify_module.block_verify
    monkeypatch.setattr(block_verify_module, "block_verify", lambda *a, **k: launches.append(1) or real(*a, **k))
    with ops.force_triton():
        forced = [o.outputs[0].token_ids for o in llm.generate(prompt_token_ids=prompts, sampling_params=params)]
    assert launches and forced == reference

