"""End-to-end generation through LLM on a tiny random checkpoint: batching, seeding, stops, pool pressure."""

import pytest
import torch
from helpers import assert_greedy_equal, small_llm
from tiny_models import make_tiny_model

from specdec import SamplingParams

GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny_llama")
    make_tiny_model(str(path), "llama", seed=3, vocab_size=300, hidden_size=64, num_layers=2)
    return str(path)


@pytest.fixture(scope="module")
def hf_model(model_dir):
    import transformers

    return transformers.LlamaForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def llm(model_dir):
    return small_llm(model_dir, dtype="float32", block_size=4, max_model_len=256)


def prompts(n, seed=0, lo=3, hi=30):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 257, (int(torch.randint(lo, hi, (1,), generator=gen)),), generator=gen).tolist()
            for _ in range(n)]


def test_greedy_matches_transformers_generate(llm, hf_model):
    for ids in prompts(4, seed=1):
        out = llm.generate(prompt_token_ids=ids, sampling_params=GREEDY)[0]
        with torch.no_grad():
            ref = hf_model.generate(torch.tensor([ids]), max_new_tokens=12, do_sample=False, eos_token_id=None,
                                    pad_token_id=0)[0, len(ids):].tolist()

        def oracle(prefix, ids=ids):
            with torch.no_grad():
                return hf_model(torch.tensor([ids + prefix])).logits[0, -1]

        assert_greedy_equal(out.outputs[0].token_ids, ref, oracle, context=f"prompt {ids}")
        assert out.outputs[0].finish_reason == "length"


def test_batched_greedy_equals_one_at_a_time(llm):
    ps = prompts(6, seed=2)
    batched = [o.outputs[0].token_ids for o in llm.generate(prompt_token_ids=ps, sampling_params=GREEDY)]
    single = [llm.generate(prompt_token_ids=p, sampling_params=GREEDY)[0].outputs[0].token_ids for p in ps]
    assert batched == single


def test_seeded_sampling_is_independent_of_batch_and_order(llm):
    target = prompts(1, seed=3)[0]
    params = SamplingParams(temperature=0.9, top_k=50, top_p=0.9, max_tokens=10, seed=1234, ignore_eos=True)
    others = prompts(3, seed=4)
    other_params = SamplingParams(temperature=1.0, max_tokens=7, ignore_eos=True)
    alone = llm.generate(prompt_token_ids=target, sampling_params=params)[0].outputs[0].token_ids
    batched = llm.generate(prompt_token_ids=[target] + others, sampling_params=[params] + [other_params] * 3)
    reordered = llm.generate(prompt_token_ids=others + [target], sampling_params=[other_params] * 3 + [params])
    assert batched[0].outputs[0].token_ids == alone
    assert reordered[-1].outputs[0].token_ids == alone
    different_seed = SamplingParams(temperature=0.9, top_k=50, top_p=0.9, max_tokens=10, seed=99, ignore_eos=True)
    assert llm.generate(prompt_token_ids=target, sampling_params=different_seed)[0].outputs[0].token_ids != alone


def test_sampling_uses_the_temperature(llm):
    ids = prompts(1, seed=5)[0]
    cold = SamplingParams(temperature=1e-4, max_tokens=8, seed=1, ignore_eos=True)
    out = llm.generate(prompt_token_ids=ids, sampling_params=cold)[0].outputs[0].token_ids
    assert out == llm.generate(prompt_token_ids=ids, sampling_params=GREEDY)[0].outputs[0].token_ids[:8]


def test_stop_token_ids_and_max_tokens_finish_reasons(llm):
    ids = prompts(1, seed=6)[0]
    free = llm.generate(prompt_token_ids=ids, sampling_params=GREEDY)[0].outputs[0].token_ids
    stop_at = free[4]
    first = free.index(stop_at)
    out = llm.generate(prompt_token_ids=ids, sampling_params=SamplingParams(
        temperature=0, max_tokens=12, stop_token_ids=[stop_at], ignore_eos=True))[0].outputs[0]
    assert out.token_ids == free[: first + 1] and out.finish_reason == "stop"
    out = llm.generate(prompt_token_ids=ids, sampling_params=SamplingParams(temperature=0, max_tokens=3))[0]
    assert len(out.outputs[0].token_ids) <= 3


def test_stop_string_cuts_text_and_keeps_completing_token(llm):
    ids = prompts(1, seed=7)[0]
    free = llm.generate(prompt_token_ids=ids, sampling_params=GREEDY)[0].outputs[0]
    text = free.text
    assert len(text) > 6
    stop = text[3:5]
    out = llm.generate(prompt_token_ids=ids, sampling_params=SamplingParams(
        temperature=0, max_tokens=12, stop=[stop], ignore_eos=True))[0].outputs[0]
    assert out.finish_reason == "stop"
    assert out.text == text[: text.index(stop)]
    decoded = llm.tokenizer.decode(out.token_ids)
    assert stop in decoded and stop not in llm.tokenizer.decode(out.token_ids[:-1])


def test_pool_pressure_all_requests_complete_and_pool_returns_to_full(model_dir, llm):
    # The pool holds ~1 full-length sequence; 10x more requests than fit at once.
    small = small_llm(model_dir, dtype="float32", block_size=4, max_model_len=64, num_kv_blocks=17)
    ps = prompts(20, seed=8, lo=10, hi=40)
    params = [SamplingParams(temperature=0, max_tokens=20, ignore_eos=True),
              SamplingParams(temperature=1.0, max_tokens=20, seed=5, ignore_eos=True)] * 10
    outs = small.generate(prompt_token_ids=ps, sampling_params=params)
    ref = llm.generate(prompt_token_ids=ps, sampling_params=params)
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in ref]
    assert sum(o.metrics["num_preemptions"] for o in outs) > 0  # the pool really was short
    bm = small.engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks
    bm.check_invariants()


def test_engine_add_step_abort(llm):
    engine = llm.engine
    a = engine.add_request(prompt_token_ids=[1, 2, 3], params=SamplingParams(temperature=0, max_tokens=50,
                                                                              ignore_eos=True))
    b = engine.add_request(prompt_token_ids=[4, 5, 6, 7], params=GREEDY)
    engine.step()
    engine.step()
    aborted = engine.abort(a)
    assert aborted.finished and aborted.outputs[0].finish_reason == "abort"
    assert len(aborted.outputs[0].token_ids) == 2 and engine.abort(a) is None  # a second abort is a no-op
    finished, reports_of_a = {}, []
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.request_id == a:
                reports_of_a.append(out)
            elif out.finished:
                finished[out.request_id] = out
    assert reports_of_a == [aborted]  # the next step reports the abort once, and nothing after it
    assert b in finished and len(finished[b].outputs[0].token_ids) == 12
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
