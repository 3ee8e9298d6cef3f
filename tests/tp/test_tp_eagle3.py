"""EAGLE-3 heads under tensor parallelism (2 gloo ranks on CPU): the head runs on rank 0 and reads the target's
hidden states from rank 0's shard of the forward (the residual stream is whole on every rank after each layer's
all-reduce); a head without its own embedding embeds with a whole copy of the target's, since the target's own
is vocabulary-parallel.

- the captured hidden states and the logits under TP=2 are the one-process engine's (fp32, within summation-order
  tolerance);
- greedy output equals plain decoding (chains and dynamic trees, batch 4), the head accepts as often as in one
  process (so it really reads the right hidden states: greedy parity alone holds for any drafts), pools whole;
- sampling stays lossless (the exact-joint oracle of tests/oracle.py);
- a head sharded over the ranks is refused.
"""

from __future__ import annotations

import oracle as lossless
import pytest
import torch
from eagle3_helpers import HEAD_HEADS, HEAD_MLP, LAYERS, assert_pools_whole, prompts
from helpers import small_llm
from test_tp_engine import assert_lossless_under_tp
from tiny_models import make_tiny_eagle3_head, make_tiny_model

from specdec import LLM, SamplingParams, SpeculativeConfig
from specdec.runner.model_runner import ForwardItem

GREEDY = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
SAMPLED = SamplingParams(temperature=1.0, seed=7, max_tokens=16, ignore_eos=True)
OPTS = {"dtype": "float32", "block_size": 4, "max_model_len": 96, "num_kv_blocks": 160}


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, str]:
    """The tiny target of test_eagle3 (4 q heads, 2 kv heads: one kv head per rank) and two heads: "structured"
    (shares the target's embedding) and "own_embedding" (its own embed_tokens, the default layers)."""
    root = tmp_path_factory.mktemp("tp_eagle3")
    out = {name: str(root / name) for name in ("target", "structured", "own_embedding", "random", "random_own")}
    make_tiny_model(out["target"], "llama", seed=3, num_layers=LAYERS, layer_output_scale=0.3)
    for name, kwargs in {"structured": {}, "own_embedding": dict(with_embed_tokens=True),
                         "random": dict(structured=False, aux_layer_ids=[1, 2, LAYERS]),
                         "random_own": dict(structured=False, with_embed_tokens=True)}.items():
        make_tiny_eagle3_head(out[name], out["target"], num_heads=HEAD_HEADS, intermediate_size=HEAD_MLP, seed=1,
                              **kwargs)
    return out


def eagle_spec(head: str, tree=None) -> SpeculativeConfig:
    return SpeculativeConfig(method="eagle3", draft_model=head, num_speculative_tokens=3, tree=tree, tree_budget=8,
                             tree_policy="always")


def capture(llm: LLM, ids: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """The engine runner's capturing forward of ``ids`` as a fresh sequence: (logits, aux hidden states)."""
    runner, bm = llm.engine.runner, llm.engine.block_manager
    bm.allocate(10_000, len(ids))
    try:
        logits, aux = runner.forward_with_aux_hidden([ForwardItem(10_000, ids, 0, len(ids))], (0, 2, LAYERS))
        return logits.clone(), aux.clone()
    finally:
        bm.free(10_000)


def test_capture_under_tp_matches_one_process(models):
    ids = prompts(1, seed=3, lo=30, hi=31)[0]
    want_logits, want_aux = capture(small_llm(models["target"], **OPTS), ids)
    with small_llm(models["target"], tensor_parallel_size=2, **OPTS) as llm:
        logits, aux = capture(llm, ids)
    assert aux.shape == want_aux.shape == (len(ids), 3 * want_aux.shape[1] // 3)
    torch.testing.assert_close(aux, want_aux, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(logits, want_logits, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("head,tree", [("structured", None), ("structured", "dynamic"), ("own_embedding", None)])
def test_greedy_output_and_acceptance_match_one_process(models, head, tree):
    ps = prompts(4, seed=11)
    plain = small_llm(models["target"], **OPTS)
    ref = [o.outputs[0].token_ids for o in plain.generate(prompt_token_ids=ps, sampling_params=GREEDY)]
    one = small_llm(models["target"], speculative=eagle_spec(models[head], tree), max_num_seqs=4, **OPTS)
    one_outs = one.generate(prompt_token_ids=ps, sampling_params=GREEDY)
    with small_llm(models["target"], tensor_parallel_size=2, speculative=eagle_spec(models[head], tree), max_num_seqs=4,
             **OPTS) as llm:
        outs = llm.generate(prompt_token_ids=ps, sampling_params=GREEDY)
        assert_pools_whole(llm)
        assert llm.engine.stats["failed_requests"] == 0
    assert [o.outputs[0].token_ids for o in outs] == ref
    accepted = [o.metrics["accepted"] for o in outs]
    assert sum(accepted) > 0
    # the same drafts as in one process (up to a rare fp32 near-tie): the head reads the right hidden states
    assert abs(sum(accepted) - sum(o.metrics["accepted"] for o in one_outs)) <= 2, (
        accepted, [o.metrics["accepted"] for o in one_outs])


@pytest.mark.parametrize("head", ["random", "random_own"])
def test_drafts_match_one_process(models, head):
    """Round after round (one seeded sampled request: the same tokens in both engines), the head's q under TP=2 equals
    its q in one process: a random head depends on every input - the hidden states of all three layers, the
    embedding (the target's whole copy on rank 0, or its own) - so a wrong row, layer or embedding shows here."""
    ps = prompts(1, seed=5, lo=20, hi=21)
    logs, tokens = [], []
    for size in (1, 2):
        log = []
        spec = eagle_spec(models[head])
        with small_llm(models["target"], tensor_parallel_size=size, speculative=spec, **OPTS) as llm:
            _spy_q(llm.engine.speculative.proposer, log)
            out = llm.generate(prompt_token_ids=ps, sampling_params=SAMPLED)[0].outputs[0]
        assert out.finish_reason == "length"
        tokens.append(out.token_ids)
        logs.append(log)
    one, tp = logs
    assert tokens[0] == tokens[1]
    assert len(one) == len(tp) > 3
    for round_one, round_tp in zip(one, tp):
        torch.testing.assert_close(round_tp, round_one, atol=1e-5, rtol=1e-4)


def _spy_q(proposer, log: list) -> None:
    """Record every proposal's q (fp32 ``[drafts, V]``) of ``proposer.propose``."""
    real = proposer.propose

    def spy(seqs, *args):
        proposal = real(seqs, *args)
        log.append(proposal.probs.clone())
        return proposal

    proposer.propose = spy


def test_eagle3_sampling_is_lossless_under_tp(tmp_path):
    """The sampled joint of tokens 1..4 (k = 2, top-k/top-p) under TP=2 against the exact target joint."""
    target, _ = lossless.make_lossless_pair(tmp_path)
    head = str(tmp_path / "head")
    make_tiny_eagle3_head(head, target, seed=9, draft_ids=[0, 2, 3], aux_layer_ids=[0, 1, 1],  # test_eagle3_lossless's
                          structured=False, num_heads=4, intermediate_size=48)
    spec = SpeculativeConfig(method="eagle3", draft_model=head, num_speculative_tokens=2)
    assert_lossless_under_tp(target, spec, "eagle3")


def test_a_sharded_head_is_refused(models):
    spec = SpeculativeConfig(method="eagle3", draft_model=models["structured"], num_speculative_tokens=3,
                             draft_tensor_parallel_size=2)
    with pytest.raises(ValueError, match="runs on rank 0 only"):
        small_llm(models["target"], tensor_parallel_size=2, speculative=spec, **OPTS)
