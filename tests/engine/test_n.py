"""n > 1: one request, n samples - shape, seeds (sample 0 = the n == 1 run), greedy samples, blocks, abort."""

import inspect

import pytest
import torch
from helpers import small_llm

import specdec
from specdec import SamplingParams, SpeculativeConfig
from specdec.sampling.params import MAX_SEED, child_seed


@pytest.fixture(scope="module")
def spec(tiny_pair):
    # Without prefix caching: a prompt found whole in the cache starts with a speculative round instead of a plain
    # prefill step, and a seeded speculative request reproduces only while it is granted the same k each step
    # (docs/guarantees.md), so "sample 0 = the n == 1 run" would compare two different k schedules.
    has_option = "enable_prefix_caching" in inspect.signature(specdec.LLM).parameters
    no_cache = {"enable_prefix_caching": False} if has_option else {}
    return small_llm(tiny_pair[0], dtype="float32", block_size=4, max_model_len=256, **no_cache,
                       speculative=SpeculativeConfig(draft_model=tiny_pair[1], num_speculative_tokens=3))


def prompts(n, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 257, (int(torch.randint(4, 20, (1,), generator=gen)),), generator=gen).tolist()
            for _ in range(n)]


def assert_all_blocks_free(llm):
    pools = llm.engine.block_managers
    for bm in pools:
        bm.check_invariants()
        assert bm.num_free_blocks == bm.num_blocks
    assert not llm.engine.has_unfinished_requests()


def sampled(n, seed=5, **kw):
    return SamplingParams(temperature=1.0, max_tokens=10, ignore_eos=True, seed=seed, n=n, **kw)


@pytest.mark.parametrize("which", ["plain", "spec"])
def test_n_samples_in_one_output_and_sample_0_is_the_n1_run(tiny_pair_plain, spec, which):
    llm = tiny_pair_plain if which == "plain" else spec
    ps = prompts(2, seed=1)
    outs = llm.generate(prompt_token_ids=ps, sampling_params=sampled(4, logprobs=1))
    assert len(outs) == 2
    for prompt, out in zip(ps, outs):
        assert out.finished and out.prompt_token_ids == prompt and len(out.outputs) == 4
        assert [c.index for c in out.outputs] == [0, 1, 2, 3]
        assert all(len(c.token_ids) == 10 and c.finish_reason == "length" for c in out.outputs)
        assert all(len(c.logprobs) == 10 for c in out.outputs)
        single = llm.generate(prompt_token_ids=prompt, sampling_params=sampled(1, logprobs=1))[0].outputs[0]
        assert out.outputs[0].token_ids == single.token_ids
        for a, b in zip(out.outputs[0].logprobs, single.logprobs):  # batch-shape float differences only
            assert list(a) == list(b) and list(a.values()) == pytest.approx(list(b.values()), abs=1e-4)
        # the other samples take other seeds: at temperature 1 they do not all repeat sample 0
        assert len({tuple(c.token_ids) for c in out.outputs}) > 1
        # sample i reproduces the n == 1 request seeded child_seed(seed, i)
        third = llm.generate(prompt_token_ids=prompt, sampling_params=sampled(1, seed=child_seed(5, 2)))[0]
        assert third.outputs[0].token_ids == out.outputs[2].token_ids
        assert out.metrics["num_generated_tokens"] == 40 and out.metrics["num_prompt_tokens"] == len(prompt)
    assert_all_blocks_free(llm)


def test_greedy_samples_are_identical(tiny_pair_plain):
    out = tiny_pair_plain.generate(prompt_token_ids=prompts(1, seed=2)[0],
                         sampling_params=SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, n=3))[0]
    assert len(out.outputs) == 3
    assert out.outputs[0].token_ids == out.outputs[1].token_ids == out.outputs[2].token_ids
    assert out.outputs[0].text == out.outputs[2].text


def test_unseeded_samples_differ(tiny_pair_plain):
    out = tiny_pair_plain.generate(prompt_token_ids=prompts(1, seed=3)[0],
                         sampling_params=SamplingParams(temperature=1.0, max_tokens=10, ignore_eos=True, n=3))[0]
    assert len({tuple(c.token_ids) for c in out.outputs}) > 1
    assert_all_blocks_free(tiny_pair_plain)


def test_step_outputs_report_every_sample_by_index(spec):
    """engine.step(): one cumulative RequestOutput per request with n > 1, every sample in it, until all are done
    (samples finish at different times: a stop token id ends some early)."""
    engine = spec.engine
    prompt = prompts(1, seed=4)[0]
    rid = engine.add_request(prompt_token_ids=prompt, params=sampled(3, seed=9))
    other = engine.add_request(prompt_token_ids=prompts(1, seed=5)[0], params=sampled(1))
    finals = {}
    while engine.has_unfinished_requests():
        outs = engine.step()
        assert len([o for o in outs if o.request_id == rid]) <= 1
        for out in outs:
            assert out.request_id in (rid, other)
            if out.request_id == rid:
                assert [c.index for c in out.outputs] == [0, 1, 2]
            if out.finished:
                finals[out.request_id] = out
    assert set(finals) == {rid, other} and len(finals[other].outputs) == 1
    assert all(len(c.token_ids) == 10 for c in finals[rid].outputs)
    assert engine.step() == []  # a finished request is reported once
    assert_all_blocks_free(spec)


@pytest.mark.parametrize("which", ["plain", "spec"])
def test_abort_of_the_request_aborts_and_frees_every_sample(tiny_pair_plain, spec, which):
    llm = tiny_pair_plain if which == "plain" else spec
    engine = llm.engine
    rid = engine.add_request(prompt_token_ids=prompts(1, seed=6)[0],
                             params=SamplingParams(temperature=1.0, max_tokens=50, ignore_eos=True, n=4, seed=1))
    for _ in range(3):
        engine.step()
    out = engine.abort(rid)
    assert out.request_id == rid and out.finished and len(out.outputs) == 4
    assert all(c.finish_reason == "abort" and 0 < len(c.token_ids) < 50 for c in out.outputs)
    assert_all_blocks_free(llm)
    assert engine.abort(rid) is None
    reported = engine.step()
    assert [o.request_id for o in reported] == [rid] and len(reported[0].outputs) == 4
    assert engine.step() == []
    # the id is free again once its abort was reported
    rid2 = engine.add_request(prompt_token_ids=[1, 2, 3], params=sampled(2), request_id=rid)
    assert rid2 == rid
    while engine.has_unfinished_requests():
        engine.step()
    assert_all_blocks_free(llm)


def test_request_id_of_a_running_group_is_in_use(tiny_pair_plain):
    engine = tiny_pair_plain.engine
    engine.add_request(prompt_token_ids=[1, 2, 3], params=sampled(2), request_id="g")
    with pytest.raises(ValueError, match="already in use"):
        engine.add_request(prompt_token_ids=[1, 2, 3], params=sampled(1), request_id="g")
    engine.abort("g")
    engine.step()
    assert_all_blocks_free(tiny_pair_plain)


def test_stream_refuses_n_above_1(tiny_pair_plain):
    with pytest.raises(ValueError, match=r"SamplingParams\.n=2"):
        next(tiny_pair_plain.stream(prompt_token_ids=[1, 2, 3], sampling_params=sampled(2)))
    assert not tiny_pair_plain.engine.has_unfinished_requests()


@pytest.mark.parametrize("value", [0, -1, 129, 1.0, True, None])
def test_bad_n_is_refused(value):
    with pytest.raises(ValueError, match=r"SamplingParams\.n=.*\[1, 128\]"):
        SamplingParams(n=value)


def test_child_seed():
    assert child_seed(123, 0) == 123
    seeds = [child_seed(s, i) for s in (0, 1, 123, MAX_SEED) for i in range(1, 50)]
    assert all(0 <= s <= MAX_SEED for s in seeds)
    assert len(set(seeds)) == len(seeds)  # distinct per (seed, index) here
    assert child_seed(7, 3) == child_seed(7, 3) != child_seed(8, 3)
    SamplingParams(seed=child_seed(MAX_SEED, 5))  # always a valid seed


def test_a_failing_sample_ends_alone(tiny_pair_plain, monkeypatch):
    """NaN logits for sample 1 only: it ends with "error" (named in RequestOutput.error), the others finish, and
    the request is reported finished once all have ended."""
    engine = tiny_pair_plain.engine
    forward = engine.runner.forward

    def nan_for_sample_1(items, input_ids=None):
        logits = forward(items, input_ids=input_ids)
        running = {s.seq_id: s for s in engine.scheduler.running}
        row, rows = 0, []
        for it in items:
            seq = running.get(it.seq_id)
            if seq is not None and seq.parent_id is not None and seq.index == 1 and len(seq.output_token_ids) >= 2:
                rows += range(row, row + it.num_logits)
            row += it.num_logits
        if rows:
            logits = logits.clone()
            logits[rows] = float("nan")
        return logits

    monkeypatch.setattr(engine.runner, "forward", nan_for_sample_1)
    out = tiny_pair_plain.generate(prompt_token_ids=prompts(1, seed=7)[0], sampling_params=sampled(3, logprobs=0))[0]
    assert out.finished and [c.finish_reason for c in out.outputs] == ["length", "error", "length"]
    assert out.error.startswith("output 1: FloatingPointError")
    assert len(out.outputs[1].token_ids) == 2 == len(out.outputs[1].logprobs)
    assert all(len(c.token_ids) == 10 == len(c.logprobs) for c in (out.outputs[0], out.outputs[2]))
    assert_all_blocks_free(tiny_pair_plain)
