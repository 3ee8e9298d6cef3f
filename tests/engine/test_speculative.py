"""Speculative decoding with a draft model: self-speculation, rollback, guards, metrics, errors."""

import json
import os
import shutil

import pytest
import torch
from helpers import small_llm
from tiny_models import make_tiny_model

from specdec import SamplingParams, SpeculativeConfig


def spec_llm(target, draft, k, **kwargs):
    return small_llm(target, dtype="float32", block_size=4, max_model_len=kwargs.pop("max_model_len", 256),
                       speculative=SpeculativeConfig(draft_model=draft, num_speculative_tokens=k), **kwargs)


def prompts(n, seed=0, lo=3, hi=40):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 257, (int(torch.randint(lo, hi, (1,), generator=gen)),), generator=gen).tolist()
            for _ in range(n)]


GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=0, max_tokens=20, ignore_eos=True),
    SamplingParams(temperature=0.8, top_k=40, top_p=0.9, max_tokens=20, ignore_eos=True, seed=7),
    SamplingParams(temperature=1.0, min_p=0.05, repetition_penalty=1.2, presence_penalty=0.3, max_tokens=20,
                   ignore_eos=True, seed=8),
])
def test_self_speculation_accepts_everything(tiny_pair, params):
    target = tiny_pair[0]
    llm = spec_llm(target, target, 4)
    outs = llm.generate(prompt_token_ids=prompts(4, seed=11), sampling_params=params)
    drafted = sum(o.metrics["drafted"] for o in outs)
    accepted = sum(o.metrics["accepted"] for o in outs)
    assert drafted > 0 and accepted / drafted >= 0.99


def test_seeded_speculative_sampling_reproduces_whatever_the_batch(tiny_pair):
    llm = spec_llm(*tiny_pair, 3)
    target = prompts(1, seed=20)[0]
    params = SamplingParams(temperature=0.9, top_p=0.95, max_tokens=16, seed=42, ignore_eos=True)
    others, other_params = prompts(3, seed=21), SamplingParams(temperature=1.0, max_tokens=9, ignore_eos=True)
    alone = llm.generate(prompt_token_ids=target, sampling_params=params)[0].outputs[0].token_ids
    batched = llm.generate(prompt_token_ids=[target] + others, sampling_params=[params] + [other_params] * 3)
    reordered = llm.generate(prompt_token_ids=others + [target], sampling_params=[other_params] * 3 + [params])
    assert batched[0].outputs[0].token_ids == alone == reordered[-1].outputs[0].token_ids


def test_stop_token_and_stop_string_inside_an_accepted_burst(tiny_pair, tiny_pair_plain):
    target = tiny_pair[0]
    llm = spec_llm(target, target, 6)  # self-speculation: every round accepts a burst of 6 + 1
    ids = prompts(1, seed=30)[0]
    free = tiny_pair_plain.generate(prompt_token_ids=ids, sampling_params=GREEDY)[0].outputs[0]
    stop_id = free.token_ids[3]
    out = llm.generate(prompt_token_ids=ids, sampling_params=SamplingParams(
        temperature=0, max_tokens=24, stop_token_ids=[stop_id], ignore_eos=True))[0]
    first = free.token_ids.index(stop_id)
    assert out.outputs[0].token_ids == free.token_ids[: first + 1] and out.outputs[0].finish_reason == "stop"
    text = free.text
    stop = text[5:7]
    out = llm.generate(prompt_token_ids=ids, sampling_params=SamplingParams(
        temperature=0, max_tokens=24, stop=stop, ignore_eos=True))[0].outputs[0]
    assert out.finish_reason == "stop" and out.text == text[: text.index(stop)]
    assert out.token_ids == free.token_ids[: len(out.token_ids)]
    out = llm.generate(prompt_token_ids=ids, sampling_params=SamplingParams(temperature=0, max_tokens=5,
                                                                            ignore_eos=True))[0].outputs[0]
    assert out.token_ids == free.token_ids[:5] and out.finish_reason == "length"


def test_guards_max_model_len_and_max_tokens(tiny_pair, tiny_pair_plain):
    llm = spec_llm(*tiny_pair, 8, max_model_len=40)
    ids = prompts(1, seed=40, lo=30, hi=31)[0]  # 30 tokens: only 10 positions left
    out = llm.generate(prompt_token_ids=ids, sampling_params=SamplingParams(temperature=0, max_tokens=10,
                                                                            ignore_eos=True))[0]
    ref = tiny_pair_plain.generate(prompt_token_ids=ids, sampling_params=SamplingParams(temperature=0, max_tokens=10,
                                                                              ignore_eos=True))[0]
    assert out.outputs[0].token_ids == ref.outputs[0].token_ids
    assert len(out.outputs[0].token_ids) == 10
    one = llm.generate(prompt_token_ids=ids, sampling_params=SamplingParams(temperature=0, max_tokens=1))[0]
    assert one.metrics["num_rounds"] == 0 and len(one.outputs[0].token_ids) == 1  # k_eff = 0: a plain step


def test_pool_pressure_with_speculation(tiny_pair, tiny_pair_plain):
    llm = spec_llm(*tiny_pair, 4, max_model_len=64, num_kv_blocks=18)
    ps = prompts(16, seed=50, lo=10, hi=40)
    outs = llm.generate(prompt_token_ids=ps, sampling_params=SamplingParams(temperature=0, max_tokens=20,
                                                                            ignore_eos=True))
    ref = tiny_pair_plain.generate(prompt_token_ids=ps, sampling_params=SamplingParams(temperature=0, max_tokens=20,
                                                                             ignore_eos=True))
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in ref]
    assert sum(o.metrics["num_preemptions"] for o in outs) > 0
    for bm in llm.engine.block_managers:
        assert bm.num_free_blocks == bm.num_blocks


def test_metrics_are_consistent(tiny_pair):
    llm = spec_llm(*tiny_pair, 3)
    for out in llm.generate(prompt_token_ids=prompts(6, seed=60), sampling_params=SamplingParams(
            temperature=0.7, max_tokens=20, ignore_eos=True, seed=3)):
        m = out.metrics
        assert m["num_generated_tokens"] == len(out.outputs[0].token_ids)
        assert m["acceptance_rate"] == pytest.approx(m["accepted"] / m["drafted"])
        assert m["mean_tokens_per_round"] <= 4 and m["num_rounds"] >= 1
        # every generated token came from a verification round, or from a plain step (prefill's, k_eff = 0)
        plain_tokens = 1 + m["k_per_step"].count(0)
        assert round(m["mean_tokens_per_round"] * m["num_rounds"]) + plain_tokens == m["num_generated_tokens"]
        assert m["num_rounds"] == len(m["k_per_step"]) - m["k_per_step"].count(0)
        assert len(m["per_position_acceptance"]) == 3
        assert m["target_forwards"] >= m["num_rounds"] and m["draft_forwards"] >= m["num_rounds"]
        assert m["wall_time"] > 0


@pytest.mark.parametrize("kwargs,match", [
    ({"num_speculative_tokens": 0}, "num_speculative_tokens must be an integer >= 1"),
    ({"method": "medusa", "draft_model": "x"}, "method 'medusa' is not supported"),
    ({"method": "draft_model"}, "needs draft_model"),
])
def test_invalid_speculative_configs(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SpeculativeConfig(**kwargs)


def _edit_tokenizer(src, dst, edit):
    shutil.copytree(src, dst)
    tok = json.loads(open(os.path.join(dst, "tokenizer.json")).read())
    edit(tok)
    with open(os.path.join(dst, "tokenizer.json"), "w") as f:
        json.dump(tok, f)


def test_vocabulary_mismatches_are_rejected(tiny_pair, tmp_path):
    target, draft = tiny_pair

    def swap(tok):
        vocab = tok["model"]["vocab"]
        a, b = "a", "b"
        vocab[a], vocab[b] = vocab[b], vocab[a]

    _edit_tokenizer(draft, tmp_path / "swapped", swap)
    with pytest.raises(ValueError, match="tokenizers differ: draft token"):
        spec_llm(target, str(tmp_path / "swapped"), 2)
    big = tmp_path / "big"
    make_tiny_model(str(big), "llama", vocab_size=400, with_tokenizer=False)
    with pytest.raises(ValueError, match="vocab_size \\(400\\) is larger"):
        spec_llm(target, str(big), 2)
    eos = tmp_path / "eos"
    shutil.copytree(draft, eos)
    cfg = json.loads((eos / "config.json").read_text())
    cfg["eos_token_id"] = 5
    (eos / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="eos ids differ"):
        spec_llm(target, str(eos), 2)


def test_smaller_draft_vocab_is_zero_padded(tiny_pair, tiny_pair_plain, tmp_path):
    target = tiny_pair[0]
    small = tmp_path / "small"
    make_tiny_model(str(small), "llama", vocab_size=280, seed=5)  # 262 real tokens, padded differently
    llm = spec_llm(target, str(small), 3)
    ps = prompts(3, seed=80)
    sampled = SamplingParams(temperature=1.0, max_tokens=12, seed=1, ignore_eos=True)
    outs = llm.generate(prompt_token_ids=ps, sampling_params=[GREEDY, sampled, GREEDY])
    ref = tiny_pair_plain.generate(prompt_token_ids=ps, sampling_params=[GREEDY, sampled, GREEDY])
    assert outs[0].outputs[0].token_ids == ref[0].outputs[0].token_ids
    assert len(outs[1].outputs[0].token_ids) == 12
