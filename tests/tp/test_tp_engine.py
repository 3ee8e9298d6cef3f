"""Tensor parallelism under the engine (2 gloo ranks on CPU): ``LLM(tensor_parallel_size=2)`` gives the
one-process engine's greedy tokens, plain and speculative (a sharded draft model's chains, a rank-0 draft's
trees, prompt lookup), and speculative sampling stays lossless (the exact-joint oracle of tests/oracle.py).
Bad tensor-parallel configurations are refused before any worker starts."""

from __future__ import annotations

import oracle as lossless
import pytest
from helpers import small_llm
from tiny_models import make_tiny_model

from specdec import SamplingParams, SpeculativeConfig

PROMPTS = ["hello there, the cat", "the cat sat on the mat, the cat sat on the", "in the beginning"]
GREEDY = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
OPTS = {"dtype": "float32", "max_model_len": 96, "block_size": 4, "num_kv_blocks": 96}


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    root = tmp_path_factory.mktemp("tp_engine")
    target, draft = str(root / "target"), str(root / "draft")
    make_tiny_model(target, model_type="qwen2", vocab_size=301, num_heads=4, num_kv_heads=2)
    make_tiny_model(draft, model_type="qwen2", vocab_size=301, num_heads=4, num_kv_heads=2, seed=5,
                    perturb_from=target, perturb_scale=0.3)
    return target, draft


@pytest.fixture(scope="module")
def reference(pair):
    """The one-process engine's greedy tokens (no speculation)."""
    return [o.outputs[0].token_ids for o in small_llm(pair[0], **OPTS).generate(PROMPTS, GREEDY)]


def tp_tokens(target: str, spec: SpeculativeConfig | None = None) -> tuple[list[list[int]], dict]:
    with small_llm(target, tensor_parallel_size=2, speculative=spec, **OPTS) as llm:
        outs = llm.generate(PROMPTS, GREEDY)
        procs = list(llm.engine.workers.procs)
        stats = llm.engine.stats
    assert all(not p.is_alive() for p in procs), "shutdown left a worker behind"
    assert all(o.outputs[0].finish_reason == "length" for o in outs)
    return [o.outputs[0].token_ids for o in outs], stats


def test_plain_greedy_matches_one_process(pair, reference):
    tokens, _ = tp_tokens(pair[0])
    assert tokens == reference


def test_payloads_that_do_not_travel_inline_follow_as_a_broadcast(pair, reference):
    """A payload over the command message's inline room (a long prefill; specdec/distributed/channel.py) follows
    the header as a broadcast on the compute group: with the room made 0 on rank 0, every payload does."""
    with small_llm(pair[0], tensor_parallel_size=2, **OPTS) as llm:
        llm.engine.workers.channel.inline_limit = 0
        outs = llm.generate(PROMPTS, GREEDY)
    assert [o.outputs[0].token_ids for o in outs] == reference


@pytest.mark.parametrize("label,spec", [
    ("sharded draft, chains", lambda d: SpeculativeConfig(draft_model=d, num_speculative_tokens=3)),
    ("rank-0 draft, trees", lambda d: SpeculativeConfig(draft_model=d, num_speculative_tokens=3, tree=[2, 2, 1],
                                                        tree_policy="always", draft_tensor_parallel_size=1)),
    ("sharded draft, trees", lambda d: SpeculativeConfig(draft_model=d, num_speculative_tokens=3, tree=[2, 1, 1],
                                                         tree_policy="always")),
    ("prompt lookup", lambda d: SpeculativeConfig(method="prompt_lookup", num_speculative_tokens=3)),
    ("ngram", lambda d: SpeculativeConfig(method="ngram_table", num_speculative_tokens=3)),
    ("combined", lambda d: SpeculativeConfig(method="combined", draft_model=d, num_speculative_tokens=3)),
])
def test_speculative_greedy_matches_plain(pair, reference, label, spec):
    tokens, stats = tp_tokens(pair[0], spec(pair[1]))
    assert tokens == reference, label
    assert stats["failed_requests"] == 0


def test_n_logprobs_and_prefix_caching_under_tp(pair):
    """What sits above the runner works unchanged under TP=2: n > 1 samples, logprobs (within fp32 tolerance of the
    one-process engine's: the logits are gathered from two shards) and prefix caching (a second request sharing a
    prompt prefix is served from the cache and decodes the same tokens), with a sharded draft model drafting."""
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, n=2, logprobs=3)
    spec = SpeculativeConfig(draft_model=pair[1], num_speculative_tokens=3)
    shared = "the cat sat on the mat, the cat sat on the mat, and then"  # > 2 blocks of 4 tokens
    one = small_llm(pair[0], speculative=spec, **OPTS)
    want = one.generate([shared], params)[0]
    with small_llm(pair[0], tensor_parallel_size=2, speculative=spec, **OPTS) as llm:
        got = llm.generate([shared], params)[0]
        again = llm.generate([shared], params)[0]  # the same prompt again: its full blocks come from the cache
    assert len(got.outputs) == 2 and [c.token_ids for c in got.outputs] == [c.token_ids for c in want.outputs]
    for mine, theirs in zip(got.outputs[0].logprobs, want.outputs[0].logprobs):
        assert set(mine) == set(theirs)
        assert all(abs(mine[t] - theirs[t]) < 1e-4 for t in mine)
    assert [c.token_ids for c in again.outputs] == [c.token_ids for c in got.outputs]
    assert again.metrics["num_cached_tokens"] > 0


def test_speculative_sampling_is_lossless_under_tp(tmp_path):
    """The sampled joint of tokens 1..4 (k = 2) under TP=2 with a sharded draft against the exact target joint."""
    target, draft = lossless.make_lossless_pair(tmp_path)
    assert_lossless_under_tp(target, SpeculativeConfig(draft_model=draft, num_speculative_tokens=2), "draft model")


def test_block_verification_is_lossless_under_tp(tmp_path):
    """Block verification (Sun et al.) under TP=2 with a draft on rank 0 against the exact target joint."""
    target, draft = lossless.make_lossless_pair(tmp_path)
    spec = SpeculativeConfig(draft_model=draft, num_speculative_tokens=2, verify="block", draft_tensor_parallel_size=1)
    assert_lossless_under_tp(target, spec, "block verification")


def assert_lossless_under_tp(target: str, spec: SpeculativeConfig, label: str) -> None:
    """Speculative sampling with ``spec`` (k = ``spec.num_speculative_tokens``, top-k / top-p) under TP=2 on the
    lossless oracle's ``target``: the sampled joint of tokens 1..k+2 matches the exact target joint (chi-square),
    and rejections happened."""
    cfg, k = lossless.CONFIGS["top_k_top_p"], spec.num_speculative_tokens
    m = k + 2
    joint = lossless.exact_joint(lossless.target_prefix_logits(target, lossless.PROMPT, m), cfg, m)
    with small_llm(target, dtype="float32", max_model_len=32, block_size=4, max_num_seqs=256, kv_cache_memory_gb=0.02,
             speculative=spec, tensor_parallel_size=2) as llm:
        counts, metrics = lossless.run(llm, cfg, m, lossless.N, f"TP=2 {label} top_k_top_p k={k}")
    stat, bound = lossless.check(f"TP=2 {label}", counts, joint)
    assert stat < bound, f"{label}: sampling under TP=2 is not lossless (chi-square {stat:.1f} >= {bound:.1f})"
    assert sum(x["accepted"] < x["drafted"] for x in metrics) > lossless.N // 10  # rejections happened


@pytest.mark.parametrize("kwargs,spec,match", [
    ({"tensor_parallel_size": 3}, None, "must divide num_attention_heads"),
    ({"tensor_parallel_size": 0}, None, "integer >= 1"),
    ({"tensor_parallel_size": 2, "quantization": "int4", "quantization_group_size": 64}, None,
     r"quantization_group_size=64 .* o_proj's input per rank \(32\).* allowed: a divisor of 32 \(2, 4, 8, 16, 32\)"),
    ({"tensor_parallel_size": 2, "distributed_timeout_s": 0}, None, "distributed_timeout_s"),
    ({"tensor_parallel_size": 2}, {"draft_tensor_parallel_size": 3}, "must be 1 .* or the target's"),
    ({"tensor_parallel_size": 2}, {"draft_quantization": "int4", "draft_quantization_group_size": 64},
     "draft_quantization_group_size=64 does not divide the draft model's"),
    ({"tensor_parallel_size": 2}, {"draft_model": "self", "draft_dtype": "bfloat16"},
     "draft_dtype must be the target's"),
])
def test_bad_configurations_are_refused(pair, kwargs, spec, match):
    speculative = None
    if spec is not None:
        speculative = SpeculativeConfig(**{"draft_model": pair[1], **spec})
    with pytest.raises(ValueError, match=match):
        small_llm(pair[0], speculative=speculative, **{**OPTS, **kwargs})


@pytest.mark.parametrize("num_kv_heads", [2, 1])  # split (1 per rank) and replicated (1 on each of 2 ranks)
def test_kv_pool_is_sized_per_rank(tmp_path, num_kv_heads):
    """``kv_cache_memory_gb`` buys each rank the blocks of *its* kv heads: every rank's pool (the driver's and the
    worker's, the same block count) fills the budget to within one block and never exceeds it. Sized as if one
    process held every kv head (the old sizing), a split pool used half the budget."""
    target = str(tmp_path / "t")
    make_tiny_model(target, model_type="qwen2", vocab_size=301, num_heads=4, num_kv_heads=num_kv_heads)
    budget_gb = 0.002
    budget = int(budget_gb * 2**30)
    with small_llm(target, dtype="float32", max_model_len=32, block_size=4, kv_cache_memory_gb=budget_gb,
             tensor_parallel_size=2) as llm:
        engine = llm.engine
        _, pool = engine.workers.shards[0]
        blocks = engine.block_manager.num_blocks
        cfg = engine.config.model_config
        per_block = 2 * cfg.num_hidden_layers * 1 * cfg.head_dim * 4 * 4  # 1 kv head per rank, fp32, 4 tokens
        assert pool.num_blocks == blocks
        assert pool.k.shape[3] == 1
        assert blocks == budget // per_block
        used = pool.k.numel() * 4 + pool.v.numel() * 4
        assert budget - per_block < used <= budget, (used, budget)
        assert [m.num_blocks for m in engine.workers.models] == [blocks]  # what the worker built its pool with
        outs = llm.generate(["hello there"], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
        assert len(outs[0].outputs[0].token_ids) == 4


def test_kv_pool_cap_is_shared_by_the_ranks_on_cpu(pair, monkeypatch):
    """On CPU the N ranks share the host's memory: the cap (half of what the weights leave) is split over them."""
    import torch

    import specdec.config.kv_pool_sizing as config_module
    from specdec.model.config import ModelConfig

    cfg = ModelConfig.from_json(pair[0])
    weights = cfg.num_params * 4
    monkeypatch.setattr(config_module, "available_memory_bytes", lambda: weights + 2 * 2**20)  # room: 1 MiB
    cpu = torch.device("cpu")
    per_rank_block = 2 * cfg.num_hidden_layers * 1 * cfg.head_dim * 4 * 4
    one = config_module.kv_pool_blocks(cfg, 4, torch.float32, cpu, 1.0)
    two = config_module.kv_pool_blocks(cfg, 4, torch.float32, cpu, 1.0, tensor_parallel_size=2)
    assert one == 2**20 // (2 * per_rank_block)  # one process: 2 kv heads per block
    assert two == 2**19 // per_rank_block  # each of 2 ranks: half the room, 1 kv head per block
