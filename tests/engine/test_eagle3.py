"""EAGLE-3 heads (``SpeculativeConfig(method="eagle3")``): the published layout, the target's hidden-state capture,
the drafts against an independent dense EAGLE-3 reference, and the engine's tree policy, static forwards and
adaptive hooks with every pool whole afterwards (greedy parity with plain decoding - chains, static and dynamic
trees, batch 1 and 4, prefill chunks, block verification, adaptive k: tests/lossless/test_greedy_parity.py).

The tiny target keeps its residual stream close to the token embedding (``layer_output_scale``), so that the
"structured" tiny head of ``make_tiny_eagle3_head`` - attention onto its own entry, the target's LM head - drafts
what the target predicts after a token often enough for rounds that accept and rounds that reject. The random
head drafts near chance but depends on every input: the reference comparison uses it.
"""

from __future__ import annotations

import json
import os

import pytest
import torch
from eagle3_helpers import (
    DRAFT_IDS,
    HEAD_HEADS,
    HEAD_MLP,
    HIDDEN,
    LAYERS,
    VOCAB,
    ReferenceHead,
    assert_pools_whole,
    hidden_states_before_norm,
    prompts,
)
from helpers import small_llm
from safetensors.torch import load_file, save_file
from tiny_models import make_tiny_eagle3_head, make_tiny_model

import specdec
from specdec import SamplingParams, SpeculativeConfig
from specdec.checkpoint.eagle3 import published_tensors
from specdec.model.eagle3 import Eagle3Config, default_aux_layers
from specdec.runner.model_runner import ForwardItem
from specdec.spec_decode.round import SpeculativeRound

GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)


# --- fixtures ----------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def target(tmp_path_factory) -> str:
    path = str(tmp_path_factory.mktemp("eagle_target"))
    make_tiny_model(path, "llama", seed=3, num_layers=LAYERS, layer_output_scale=0.3)
    return path


@pytest.fixture(scope="module")
def heads(tmp_path_factory, target) -> dict[str, str]:
    """name -> folder: "structured" (full vocabulary), "draft_vocab" (structured, vocabulary DRAFT_IDS), "random"
    (random weights, DRAFT_IDS, layers 1 / 2 / L named in the config), "random_default" (the default layers,
    speculators' ``layers.0.`` spelling, its own embedding, norm_before_residual)."""
    root = tmp_path_factory.mktemp("eagle_heads")
    specs = {
        "structured": dict(seed=1),
        "draft_vocab": dict(seed=2, draft_ids=DRAFT_IDS),
        "random": dict(seed=4, draft_ids=DRAFT_IDS, structured=False, aux_layer_ids=[1, 2, LAYERS]),
        "random_default": dict(seed=5, structured=False, layer_prefix="layers.0.", with_embed_tokens=True,
                               norm_before_residual=True),
    }
    out = {}
    for name, kwargs in specs.items():
        out[name] = str(root / name)
        make_tiny_eagle3_head(out[name], target, num_heads=HEAD_HEADS, intermediate_size=HEAD_MLP, **kwargs)
    return out


@pytest.fixture(scope="module")
def plain(target):
    return small_llm(target, dtype="float32", block_size=4, max_model_len=128, num_kv_blocks=200)


def eagle_llm(target, head, **kwargs) -> specdec.LLM:
    """An engine drafting with ``head``; a tree is drafted every round (``tree_policy="always"``) unless told
    otherwise: the tests of trees must see trees (the measured default may draft the chain)."""
    spec = SpeculativeConfig(method="eagle3", draft_model=head, num_speculative_tokens=kwargs.pop("k", 3),
                             tree=kwargs.pop("tree", None), tree_budget=kwargs.pop("tree_budget", 8),
                             tree_policy=kwargs.pop("tree_policy", "always"), verify=kwargs.pop("verify", "token"),
                             adaptive=kwargs.pop("adaptive", False), cost_model=kwargs.pop("cost_model", None))
    return small_llm(target, dtype="float32", block_size=4, max_model_len=kwargs.pop("max_model_len", 128),
                       num_kv_blocks=kwargs.pop("num_kv_blocks", 200), speculative=spec, **kwargs)


# --- the published layout ----------------------------------------------------------------------------------------
# The published EAGLE-3 head (``LlamaForCausalLMEagle3``), for hidden size H, target hidden size Ht, Hq heads and Hkv
# KV heads of size D, MLP size I, draft vocabulary Vd, target vocabulary V. Written by SpecForge's
# LlamaForCausalLMEagle3 (specforge/modeling/draft/llama3_eagle.py: embed_tokens [V, H]; midlayer = a decoder layer
# whose q/k/v_proj take hidden_size * 2 inputs, with hidden_norm, input_layernorm, post_attention_layernorm and a
# llama MLP; fc: Linear(target_hidden_size * 3, hidden_size, bias=False); norm; lm_head: Linear(hidden_size,
# draft_vocab_size); buffers d2t int64 [draft_vocab_size] and t2d bool [vocab_size]) and read by vLLM's
# Eagle3LlamaForCausalLM (vllm/model_executor/models/llama_eagle3.py: "midlayer." read as "layers.0.", qkv over
# 2 * hidden_size, fc over target_hidden_size * 3, d2t loaded as draft_id_to_target_id = target id - draft id,
# t2d skipped, embed_tokens optional) and SGLang's python/sglang/srt/models/llama_eagle3.py.
def published_layout(h, ht, hq, hkv, d, i, vd, v) -> dict[str, tuple[int, ...]]:
    return {
        "fc.weight": (h, 3 * ht),
        "midlayer.hidden_norm.weight": (h,),
        "midlayer.input_layernorm.weight": (h,),
        "midlayer.self_attn.q_proj.weight": (hq * d, 2 * h),
        "midlayer.self_attn.k_proj.weight": (hkv * d, 2 * h),
        "midlayer.self_attn.v_proj.weight": (hkv * d, 2 * h),
        "midlayer.self_attn.o_proj.weight": (h, hq * d),
        "midlayer.post_attention_layernorm.weight": (h,),
        "midlayer.mlp.gate_proj.weight": (i, h),
        "midlayer.mlp.up_proj.weight": (i, h),
        "midlayer.mlp.down_proj.weight": (h, i),
        "norm.weight": (h,),
        "lm_head.weight": (vd, h),
        "d2t": (vd,),  # optional when Vd == V (vLLM then maps draft id i to target id i)
        "t2d": (v,),  # optional
        "embed_tokens.weight": (v, h),  # optional: without it the head embeds with the target's embedding
    }


def test_published_layout_names_and_shapes(heads):
    config = Eagle3Config.from_json(heads["draft_vocab"])
    required, optional = published_tensors(config)
    want = published_layout(HIDDEN, HIDDEN, HEAD_HEADS, HEAD_HEADS, HIDDEN // HEAD_HEADS, HEAD_MLP, len(DRAFT_IDS),
                            VOCAB)
    assert required | optional == want
    assert set(optional) == {"t2d", "embed_tokens.weight"}  # d2t is required: the draft vocabulary is smaller
    written = load_file(os.path.join(heads["draft_vocab"], "model.safetensors"))
    assert {name: tuple(t.shape) for name, t in written.items()} == {k: s for k, s in want.items()
                                                                   if k != "embed_tokens.weight"}
    assert written["d2t"].dtype == torch.int64 and written["t2d"].dtype == torch.bool
    # d2t is an offset: draft id i is target id i + d2t[i]
    assert (torch.arange(len(DRAFT_IDS)) + written["d2t"]).tolist() == DRAFT_IDS


def test_config_keys_and_default_layers(heads):
    config = Eagle3Config.from_json(heads["random"])
    assert config.aux_layers(LAYERS) == (1, 2, LAYERS) and config.draft_vocab_size == len(DRAFT_IDS)
    default = Eagle3Config.from_json(heads["random_default"])
    # vLLM's default (2, L // 2, L - 3): ids count the hidden state entering a layer (SpecForge: (1, L//2-1, L-4)
    # counted as layer outputs - the same states)
    assert default.aux_layer_ids is None and default.aux_layers(32) == (2, 16, 29) == default_aux_layers(32)
    assert default.norm_before_residual and not config.norm_before_residual


def _copy_head(src, dst, drop=(), add=None, config=None):
    tensors = load_file(os.path.join(src, "model.safetensors"))
    tensors = {k: v for k, v in tensors.items() if k not in drop} | (add or {})
    os.makedirs(dst, exist_ok=True)
    save_file(tensors, os.path.join(dst, "model.safetensors"))
    with open(os.path.join(src, "config.json")) as f:
        raw = json.load(f)
    with open(os.path.join(dst, "config.json"), "w") as f:
        json.dump(raw | (config or {}), f)
    return dst


@pytest.mark.parametrize("case,match", [
    ("missing_fc", r"missing \['fc.weight'\]"),
    ("missing_hidden_norm", r"missing \['midlayer.hidden_norm.weight'\]"),
    ("missing_d2t", r"missing \['d2t'\]"),
    ("unknown_tensor", r"does not have: \['midlayer.extra.weight'\]"),
    ("wrong_shape", r"'midlayer.self_attn.q_proj.weight' has shape \(64, 64\), expected \(64, 128\)"),
    ("bad_d2t", "d2t does not map"),
    ("t2d_mismatch", "t2d does not mark exactly the target ids d2t maps to"),
    ("not_eagle", "is not an EAGLE-3 head"),
    ("speculators_config", "speculators' own config layout"),
    ("two_layers", "one decoder layer"),
    ("eagle1", "use_aux_hidden_state is false"),
    ("bad_layer_ids", "name layers outside the target"),
    ("vocab_mismatch", "is not the target's"),
])
def test_an_unknown_layout_is_refused_with_a_clear_message(target, heads, tmp_path, case, match):
    src = heads["draft_vocab"]
    dst = str(tmp_path / case)
    q = load_file(os.path.join(src, "model.safetensors"))["midlayer.self_attn.q_proj.weight"]
    d2t = load_file(os.path.join(src, "model.safetensors"))["d2t"]
    {
        "missing_fc": lambda: _copy_head(src, dst, drop=["fc.weight"]),
        "missing_hidden_norm": lambda: _copy_head(src, dst, drop=["midlayer.hidden_norm.weight"]),
        "missing_d2t": lambda: _copy_head(src, dst, drop=["d2t"]),
        "unknown_tensor": lambda: _copy_head(src, dst, add={"midlayer.extra.weight": torch.zeros(2)}),
        "wrong_shape": lambda: _copy_head(src, dst, add={"midlayer.self_attn.q_proj.weight": q[:, :HIDDEN].clone()}),
        "bad_d2t": lambda: _copy_head(src, dst, add={"d2t": torch.full_like(d2t, VOCAB)}),
        "t2d_mismatch": lambda: _copy_head(src, dst, add={"d2t": torch.zeros_like(d2t)}),
        "not_eagle": lambda: _copy_head(src, dst, config={"architectures": ["LlamaForCausalLM"]}),
        "speculators_config": lambda: _copy_head(src, dst, config={"architectures": ["Eagle3Speculator"]}),
        "two_layers": lambda: _copy_head(src, dst, config={"num_hidden_layers": 2}),
        "eagle1": lambda: _copy_head(src, dst, config={"eagle_config": {"use_aux_hidden_state": False}}),
        "bad_layer_ids": lambda: _copy_head(src, dst, config={"eagle_aux_hidden_state_layer_ids": [1, 2, 9]}),
        "vocab_mismatch": lambda: _copy_head(src, dst, drop=["t2d"], config={"vocab_size": 280}),
    }[case]()
    with pytest.raises(ValueError, match=match):
        eagle_llm(target, dst)


def test_a_standalone_model_is_not_taken_for_a_head(target):
    with pytest.raises(ValueError, match="is not an EAGLE-3 head"):
        eagle_llm(target, target)


# --- the target's hidden states ------------------------------------------------------------------------------------
def test_capture_leaves_the_logits_bitwise_and_matches_transformers_hidden_states(plain, target):
    """The capturing forward gives bitwise the logits of the plain one (fp32), and its captured states are
    transformers' ``hidden_states[k]`` for each id k < L (0 the embeddings) and, for L, the last layer's output
    before the final norm (vLLM's id L; transformers' ``hidden_states[L]`` is after the norm)."""
    import transformers

    engine = plain.engine
    runner, bm = engine.runner, engine.block_manager
    ids = prompts(1, seed=3, lo=30, hi=31)[0]
    layers = (0, 2, LAYERS)
    bm.allocate(10_000, len(ids))
    try:
        item = ForwardItem(10_000, ids, 0, len(ids))
        logits = runner.forward([item]).clone()
        captured, aux = runner.forward_with_aux_hidden([item], layers)
    finally:
        bm.free(10_000)
    assert torch.equal(logits, captured)
    hf = transformers.LlamaForCausalLM.from_pretrained(target, dtype=torch.float32).eval()
    states = hidden_states_before_norm(hf, ids)
    want = torch.cat([states[k] for k in layers], dim=-1)
    torch.testing.assert_close(aux, want, atol=1e-4, rtol=1e-4)
    with torch.no_grad():
        normed = hf(torch.tensor([ids]), output_hidden_states=True).hidden_states[LAYERS][0]
    torch.testing.assert_close(hf.model.norm(aux[:, -HIDDEN:]), normed, atol=1e-4, rtol=1e-4)


def test_no_capture_without_an_eagle_proposer(target, heads, monkeypatch):
    """A plain engine never takes the capturing path; an EAGLE-3 engine always does (and caches no prefixes)."""
    plain_llm = small_llm(target, dtype="float32", block_size=4, max_model_len=64, num_kv_blocks=64)
    calls = []
    monkeypatch.setattr(plain_llm.engine.runner, "forward_with_aux_hidden", lambda *a, **k: calls.append(a))
    plain_llm.generate(prompt_token_ids=prompts(2, seed=4), sampling_params=GREEDY)
    assert not calls
    llm = eagle_llm(target, heads["structured"])
    assert llm.engine.speculative.proposer.aux_hidden_layers == default_aux_layers(LAYERS)
    assert llm.engine.block_manager.prefix_cache is None


# --- the drafts against a dense reference --------------------------------------------------------------------------
def _spy(proposer, name, log):
    real = getattr(proposer, name)

    def spy(seqs, *args):
        proposal = real(seqs, *args)
        log.append(([list(s.all_token_ids) for s in seqs], [s.params.is_greedy for s in seqs], proposal))
        return proposal

    setattr(proposer, name, spy)


@pytest.mark.parametrize("head", ["random", "random_default"])
def test_chain_drafts_match_the_dense_reference(target, heads, head):
    """Greedy drafts and sampled q, round after round (prefill chunks, accepted and rejected rounds, batch of 3),
    equal a dense EAGLE-3 written from the published description fed transformers' hidden states."""
    llm = eagle_llm(target, heads[head], max_num_seqs=3, max_num_batched_tokens=16, prepack_weights=False)
    log = []
    _spy(llm.engine.speculative.proposer, "propose", log)
    params = [GREEDY, SamplingParams(temperature=1.0, seed=7, max_tokens=14, ignore_eos=True), GREEDY]
    ps = prompts(3, seed=11, lo=5, hi=30)
    llm.generate(prompt_token_ids=ps, sampling_params=params)
    ref = ReferenceHead(heads[head], target)
    checked = 0
    for contexts, greedy, proposal in log:
        drafts = proposal.device_ids.tolist()
        offset = 0
        for b, (context, is_greedy) in enumerate(zip(contexts, greedy)):
            k = proposal.counts()[b]
            for j in range(k):
                q = ref.path_q(context, drafts[offset : offset + j])
                if is_greedy:
                    assert drafts[offset + j] == int(q.argmax()), f"draft {j} of {context}"
                else:
                    torch.testing.assert_close(proposal.probs[offset + j], q, atol=2e-5, rtol=1e-4)
                    assert q[drafts[offset + j]] > 0
                checked += 1
            offset += k
    assert checked > 40


def test_tree_q_matches_the_dense_reference(target, heads):
    """Every fed node's q in sampled static and dynamic trees equals the reference's q after the node's path
    (tree attention over the head's cache, each node fed its parent's output hidden state)."""
    ref = ReferenceHead(heads["random"], target)
    checked = 0
    for tree in ([2, 2, 1], "dynamic"):
        llm = eagle_llm(target, heads["random"], tree=tree, tree_budget=7, max_num_seqs=2, prepack_weights=False)
        log = []
        _spy(llm.engine.speculative.proposer, "propose_tree", log)
        params = [SamplingParams(temperature=1.0, seed=s, max_tokens=10, ignore_eos=True) for s in (1, 2)]
        llm.generate(prompt_token_ids=prompts(2, seed=12, lo=4, hi=20), sampling_params=params)
        for contexts, _, proposal in log:
            row = 0
            for context, t in zip(contexts, proposal.trees):
                for node in range(len(t.token_ids)):
                    q = proposal.probs[row + node]
                    if bool(q.any()):  # a fed node (a leaf at the depth cap has no q)
                        torch.testing.assert_close(q, ref.path_q(context, list(t.path_tokens(node))),
                                                   atol=2e-5, rtol=1e-4)
                        checked += 1
                row += len(t.token_ids)
    assert checked > 20


# --- greedy output in the engine (the parity matrix: tests/lossless/test_greedy_parity.py) -----------------------
@pytest.mark.parametrize("adaptive", [False, True])
@pytest.mark.parametrize("tree_window_cost", [0.0, 50.0])
def test_measured_tree_policy_chooses_eagle3_trees_by_value(target, heads, plain, adaptive, tree_window_cost):
    """tree_policy="measured" (the default) weighs an EAGLE-3 tree against its chain as it does a draft model's
    (injected costs: a chain window of k + 1 tokens costs 1 + 0.1 k decodes). Tree windows that cost a decode
    whatever their size: trees in most rounds; 50x dearer per node: only in exploration rounds. Either way the
    tokens are the plain greedy ones and every pool is whole."""
    from specdec.spec_decode.cost_model import FixedCostModel

    ps = prompts(2, seed=50)
    params = SamplingParams(temperature=0, max_tokens=80, ignore_eos=True)
    ref = [o.outputs[0].token_ids for o in plain.generate(prompt_token_ids=ps, sampling_params=params)]
    costs = FixedCostModel(c=0.0, verify_slope=0.1, tree_verify_factor=tree_window_cost)
    llm = eagle_llm(target, heads["structured"], tree=[2, 2, 1], tree_policy="measured", cost_model=costs,
                    adaptive=adaptive, max_num_seqs=1)
    calls = {"propose": [], "propose_tree": []}
    for name, log in calls.items():
        _spy(llm.engine.speculative.proposer, name, log)
    outs = llm.generate(prompt_token_ids=ps, sampling_params=params)
    assert [o.outputs[0].token_ids for o in outs] == ref
    trees, rounds = len(calls["propose_tree"]), len(calls["propose"]) + len(calls["propose_tree"])
    assert rounds > 0 and sum(o.metrics["accepted"] for o in outs) > 0
    if tree_window_cost == 0.0:
        assert trees >= 0.6 * rounds, (trees, rounds)
    else:
        assert 0 < trees <= rounds / 8, (trees, rounds)  # measured (explored), then left alone
    assert_pools_whole(llm)


def test_one_token_prompts_and_sampling_with_penalties(target, heads, monkeypatch):
    """A one-token prompt drafts from its second step on (nothing to feed the head before); sampled requests
    with penalties and filters run and are reproducible by seed."""
    llm = eagle_llm(target, heads["draft_vocab"], max_num_seqs=4)
    verify = SpeculativeRound.verify
    drafted: list[int] = []

    def spy(self, logits, out):
        meta = self.meta
        drafted.extend(meta.draft_token_ids.tolist())
        outside = torch.ones(VOCAB, dtype=torch.bool).index_fill_(0, torch.tensor(DRAFT_IDS), False)
        assert not bool(meta.draft_probs[:, outside].any()), "q must be zero outside the draft vocabulary"
        return verify(self, logits, out)

    monkeypatch.setattr(SpeculativeRound, "verify", spy)
    params = SamplingParams(temperature=0.9, top_p=0.95, top_k=50, repetition_penalty=1.2, frequency_penalty=0.3,
                            max_tokens=20, seed=5, ignore_eos=True)
    ps = [[7], [8, 9], *prompts(2, seed=30)]
    first = llm.generate(prompt_token_ids=ps, sampling_params=params)
    assert drafted and set(drafted) <= set(DRAFT_IDS)
    again = llm.generate(prompt_token_ids=ps, sampling_params=params)
    assert all(o.outputs[0].finish_reason == "length" for o in first), [o.error for o in first]
    assert [o.outputs[0].token_ids for o in first] == [o.outputs[0].token_ids for o in again]
    assert sum(o.metrics["num_rounds"] for o in first) > 0
    assert_pools_whole(llm)


def test_static_forwards_change_no_greedy_token(target, heads, plain):
    """An engine with static forwards (the target's forward capturing hidden states runs eagerly beside them) emits
    the plain greedy tokens (block verification and adaptive k: tests/lossless/test_greedy_parity.py)."""
    ps = prompts(4, seed=40)
    ref = [o.outputs[0].token_ids for o in plain.generate(prompt_token_ids=ps, sampling_params=GREEDY)]
    llm = eagle_llm(target, heads["structured"], max_num_seqs=4)
    llm.engine.enable_static_forward("eager")
    outs = llm.generate(prompt_token_ids=ps, sampling_params=GREEDY)
    assert [o.outputs[0].token_ids for o in outs] == ref
    assert sum(o.metrics["accepted"] for o in outs) > 0
    # the target's pool lends one block to the padding rows; the head has no static path (and no scratch block)
    assert llm.engine.speculative.proposer.draft_model is None and llm.engine.runner.static is not None
    target_pool, head_pool = llm.engine.block_managers
    assert target_pool.num_free_blocks == target_pool.num_blocks - 1
    assert head_pool.num_free_blocks == head_pool.num_blocks


def test_reset_adaptive_hooks_the_heads_draft_timings_to_the_fresh_cost_model(target, heads):
    """``SpeculationPolicy.reset_adaptive`` (a cold start after a warm-up) gives the head's timed draft steps to
    the new cost model, not the forgotten one."""
    speculator = eagle_llm(target, heads["structured"], adaptive=True).engine.speculative
    policy = speculator.policy
    old = policy.cost_model
    policy.reset_adaptive()
    assert policy.cost_model is not old
    seen = []
    policy.cost_model.observe_draft = lambda batch_size, seconds: seen.append((batch_size, seconds))
    speculator.proposer.on_forward(3, 0.25)  # what the head calls after a timed draft step
    assert seen == [(3, 0.25)]
