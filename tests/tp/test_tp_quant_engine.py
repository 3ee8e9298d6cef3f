"""Quantised models and ``draft_model="self"`` under ``LLM(tensor_parallel_size=2)`` (2 gloo ranks on CPU, the
shared ``tiny_pair``): an int4 / grouped int8 target gives the one-process quantised engine's greedy tokens; greedy
speculative decoding with an int4 draft - sharded over both ranks or on rank 0 alone - and with a quantised self
draft gives plain TP=2 greedy's tokens of the same target. (Refusals: test_tp_engine.py's bad configurations.)"""

from __future__ import annotations

import pytest
from helpers import small_llm

from specdec import LLM, SamplingParams, SpeculativeConfig
from specdec.model.quant.linear import QuantizedLinear

GREEDY = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
PROMPTS = [[1, 2, 3, 4], [7, 9, 11, 13, 200, 17], [40, 41, 42]]
OPTS = {"dtype": "float32", "max_model_len": 96, "block_size": 4, "num_kv_blocks": 96}


def tokens(target: str, tp: int, **kwargs) -> tuple[list[list[int]], LLM, int]:
    """Greedy tokens of every prompt, the (shut down) engine for inspection, and the draft tokens accepted."""
    with small_llm(target, tensor_parallel_size=tp, **OPTS, **kwargs) as llm:
        outs = llm.generate(prompt_token_ids=PROMPTS, sampling_params=GREEDY)
        assert llm.engine.stats["failed_requests"] == 0
    return [o.outputs[0].token_ids for o in outs], llm, sum(o.metrics.get("accepted", 0) for o in outs)


@pytest.fixture(scope="module")
def plain_tp2(tiny_pair):
    """Plain TP=2 greedy tokens of the fp32 target, and of the int8 target."""
    return {q: tokens(tiny_pair[0], 2, quantization=q)[0] for q in (None, "int8")}


@pytest.mark.parametrize("quantization,group", [("int4", None), ("int8", 16)])
def test_quantised_target_matches_one_process(tiny_pair, quantization, group):
    """Schemes whose shards are the one-process quantisation exactly (test_tp_quant.py). Not per-channel int8:
    under TP its scales and w8a8's activation rows are per rank's shard, a slightly different quantisation, and
    this model has a near tie (top-2 logprob gap 0.015 in fp32) that one-process int8 and TP=2 int8 break apart."""
    one = tokens(tiny_pair[0], 1, quantization=quantization, quantization_group_size=group)[0]
    two = tokens(tiny_pair[0], 2, quantization=quantization, quantization_group_size=group)[0]
    assert two == one


@pytest.mark.parametrize("target_q,draft,draft_tp", [
    (None, "draft", 2),  # an int4 draft model sharded over both ranks
    (None, "draft", 1),  # on rank 0 alone
    (None, "self", 2),  # the target's checkpoint as an int4 draft, sharing each rank's embedding shard
    (None, "self", 1),  # on rank 0 alone: reads the full embedding
    ("int8", "self", 2),  # an int4 self draft of an int8 target
])
def test_quantised_drafts_are_lossless_under_tp(tiny_pair, plain_tp2, target_q, draft, draft_tp):
    spec = SpeculativeConfig(draft_model=tiny_pair[1] if draft == "draft" else "self", draft_quantization="int4",
                             num_speculative_tokens=3, draft_tensor_parallel_size=draft_tp)
    got, llm, accepted = tokens(tiny_pair[0], 2, quantization=target_q, speculative=spec)
    assert got == plain_tp2[target_q]
    draft_model = llm.engine.speculative.proposer.runner.model
    draft_model, target = (getattr(m, "local", m) for m in (draft_model, llm.engine.model))  # rank 0's shards
    assert isinstance(draft_model.layers[0].mlp.down_proj, QuantizedLinear)
    assert (len(llm.engine.workers.shards) == 2) == (draft_tp == 2)
    vocab = llm.engine.model_config.vocab_size
    if draft == "self" and draft_tp == 2:  # rank 0's half of the vocabulary, the target's own tensor
        assert draft_model.embed_tokens.weight is target.embed_tokens.weight
        assert draft_model.embed_tokens.weight.shape[0] == vocab // 2
    elif draft == "self":
        assert draft_model.embed_tokens.weight.shape[0] == vocab  # its own full embedding on rank 0
    assert accepted > 0
