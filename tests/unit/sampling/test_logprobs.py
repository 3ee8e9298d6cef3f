"""logprobs: the emitted tokens' raw log-probabilities from the target (docs/metrics.md), checked against a
transformers oracle, with and without speculation, through stop truncation and streaming, plus validation."""

import pytest
import torch
from helpers import small_llm

from specdec import SamplingParams, SpeculativeConfig
from specdec.sampling.logprobs import token_logprobs

TOL = 1e-4  # fp32: our forward vs transformers', and batch-shape differences between plain and speculative rows
TOP = 5


@pytest.fixture(scope="module")
def hf_model(tiny_pair):
    import transformers

    return transformers.LlamaForCausalLM.from_pretrained(tiny_pair[0], dtype=torch.float32).eval()


SPEC_CONFIGS = {
    "ngram": lambda draft: SpeculativeConfig(method="ngram_table", num_speculative_tokens=4),
    "draft_model": lambda draft: SpeculativeConfig(draft_model=draft, num_speculative_tokens=4),
    "draft_model_block": lambda draft: SpeculativeConfig(draft_model=draft, num_speculative_tokens=4, verify="block"),
    # a token j on an accepted tree path comes from its node's row, not from row j
    "draft_tree": lambda draft: SpeculativeConfig(draft_model=draft, num_speculative_tokens=3, tree_policy="always",
                                                  tree=[2, 2, 1]),
}


@pytest.fixture(scope="module")
def spec_llms(tiny_pair):
    return {method: small_llm(tiny_pair[0], dtype="float32", block_size=4, max_model_len=256,
                                speculative=config(tiny_pair[1]))
            for method, config in SPEC_CONFIGS.items()}


def repetitive_prompts(n, seed=0):
    """Prompts that repeat a unit, so the n-gram drafter finds matches and rounds accept several tokens."""
    gen = torch.Generator().manual_seed(seed)
    units = [torch.randint(0, 257, (int(torch.randint(3, 7, (1,), generator=gen)),), generator=gen).tolist()
             for _ in range(n)]
    return [u * 4 for u in units]


def oracle_logprobs(hf_model, prompt, output):
    """fp32 ``[len(output), V]``: log_softmax of transformers' logits at the position of each output token."""
    with torch.no_grad():
        logits = hf_model(torch.tensor([prompt + output])).logits[0]
    return torch.log_softmax(logits[len(prompt) - 1 : len(prompt) + len(output) - 1].float(), dim=-1)


def assert_matches_oracle(completion, ref, top_n):
    """Each token's dict: its first ``top_n`` entries are the oracle's top-n (ids and values, descending), then the
    token itself when not among them, its value the oracle's; the cumulative logprob is their sum."""
    assert len(completion.logprobs) == len(completion.token_ids) == ref.shape[0]
    for i, (token, entry) in enumerate(zip(completion.token_ids, completion.logprobs)):
        assert entry[token] == pytest.approx(ref[i, token].item(), abs=TOL), f"token {i}"
        ids, values = list(entry), list(entry.values())
        top = torch.topk(ref[i], top_n)
        assert ids[:top_n] == top.indices.tolist(), f"top-{top_n} ids at token {i}"
        assert values[:top_n] == pytest.approx(top.values.tolist(), abs=TOL)
        assert values[:top_n] == sorted(values[:top_n], reverse=True)
        assert len(entry) == top_n + (token not in ids[:top_n])
    expected = sum(entry[t] for t, entry in zip(completion.token_ids, completion.logprobs))
    assert completion.cumulative_logprob == pytest.approx(expected, abs=1e-9)


PARAMS = {
    "greedy": SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, logprobs=TOP),
    # raw logprobs ignore temperature, penalties and filtering: the oracle is the plain log_softmax all the same
    "sampled": SamplingParams(temperature=0.7, top_k=20, top_p=0.9, repetition_penalty=1.3, presence_penalty=0.5,
                              max_tokens=10, ignore_eos=True, seed=11, logprobs=TOP),
}


@pytest.mark.parametrize("name", list(PARAMS))
def test_logprobs_equal_the_oracles_log_softmax(tiny_pair_plain, hf_model, name):
    prompts = repetitive_prompts(3, seed=1)
    outs = tiny_pair_plain.generate(prompt_token_ids=prompts, sampling_params=PARAMS[name])
    for prompt, out in zip(prompts, outs):
        c = out.outputs[0]
        assert_matches_oracle(c, oracle_logprobs(hf_model, prompt, c.token_ids), TOP)


def test_logprobs_are_raw_not_after_temperature_or_penalties(tiny_pair_plain, hf_model):
    """The definition is checked, not just the numbers: at temperature 0.5 with a repetition penalty, the values
    are the raw log_softmax and measurably not the processed (tempered, penalised) one."""
    prompt = repetitive_prompts(1, seed=2)[0]
    params = SamplingParams(temperature=0.5, repetition_penalty=1.5, max_tokens=6, ignore_eos=True, seed=3, logprobs=0)
    c = tiny_pair_plain.generate(prompt_token_ids=prompt, sampling_params=params)[0].outputs[0]
    with torch.no_grad():
        logits = hf_model(torch.tensor([prompt + c.token_ids])).logits[0, len(prompt) - 1 : -1]
    raw = torch.log_softmax(logits, -1)
    tempered = torch.log_softmax(logits / 0.5, -1)
    got = torch.tensor([e[t] for t, e in zip(c.token_ids, c.logprobs)])
    idx = torch.arange(len(c.token_ids)), torch.tensor(c.token_ids)
    torch.testing.assert_close(got, raw[idx], atol=TOL, rtol=0)
    assert (got - tempered[idx]).abs().max() > 100 * TOL
    assert [list(e) for e in c.logprobs] == [[t] for t in c.token_ids]  # logprobs=0: the token only


@pytest.mark.parametrize("method", list(SPEC_CONFIGS))
def test_speculation_gives_the_same_logprobs(tiny_pair_plain, spec_llms, hf_model, method):
    """Greedy: the same tokens with and without speculation, and the same numbers for them (a verified token j
    comes from row j of its window; mapping every token of a round to row 0 fails here). Sampled: speculative
    tokens differ from plain ones, so they are checked against the oracle for their own prefixes. Trees: a token
    on the accepted path comes from its node's row."""
    llm = spec_llms[method]
    prompts = repetitive_prompts(4, seed=3)
    greedy = PARAMS["greedy"]
    ref = tiny_pair_plain.generate(prompt_token_ids=prompts, sampling_params=greedy)
    outs = llm.generate(prompt_token_ids=prompts, sampling_params=greedy)
    assert sum(o.metrics["accepted"] for o in outs) > 0  # rounds emitted several tokens
    for r, o in zip(ref, outs):
        a, b = r.outputs[0], o.outputs[0]
        assert b.token_ids == a.token_ids
        for ea, eb in zip(a.logprobs, b.logprobs):
            assert list(eb) == list(ea)
            assert list(eb.values()) == pytest.approx(list(ea.values()), abs=TOL)
        assert b.cumulative_logprob == pytest.approx(a.cumulative_logprob, abs=TOL * len(a.token_ids))
    sampled = llm.generate(prompt_token_ids=prompts, sampling_params=SamplingParams(
        temperature=0.5, top_k=20, max_tokens=16, ignore_eos=True, seed=5, logprobs=TOP))
    assert sum(o.metrics["accepted"] for o in sampled) > 0
    for prompt, o in zip(prompts, sampled):
        c = o.outputs[0]
        assert_matches_oracle(c, oracle_logprobs(hf_model, prompt, c.token_ids), TOP)


def run_steps(engine, prompt, params):
    """(final completion, token counts after each step that emitted) of one request, stepped by hand."""
    rid = engine.add_request(prompt_token_ids=prompt, params=params)
    counts, final = [], None
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.request_id == rid:
                counts.append(len(out.outputs[0].token_ids))
                final = out
    return final, counts


def mid_step_stop(tok, tokens, step_ends):
    """(index i, stop string) such that the text first contains the stop string when token i is appended, and
    token i is not the last token of its step; None if this output has no such token."""
    for i in range(5, len(tokens) - 1):
        before, piece = tok.decode(tokens[:i]), tok.decode(tokens[i : i + 1])
        after = tok.decode(tokens[: i + 1])
        if (i + 1 not in step_ends and piece.strip() and "\ufffd" not in after + piece and after == before + piece
                and piece not in before):
            return i, piece
    return None


@pytest.mark.parametrize("method", [None, "draft_model"])
def test_logprobs_stay_aligned_after_stop_string_truncation(tiny_pair, tiny_pair_plain, spec_llms, method):
    """A stop string completed by a token in the middle of a step's tokens (mid-round when speculating): the
    tokens after it are dropped together with their logprobs."""
    llm = tiny_pair_plain if method is None else spec_llms[method]
    greedy = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=2)
    gen = torch.Generator().manual_seed(6)
    for _ in range(20):
        prompt = torch.randint(0, 257, (12,), generator=gen).tolist()
        full, step_ends = run_steps(llm.engine, prompt, greedy)
        found = mid_step_stop(llm.tokenizer, full.outputs[0].token_ids, step_ends if method else [])
        if found is not None:
            break
    assert found is not None, "no output with a usable stop token (the test would prove nothing)"
    i, stop = found
    full = full.outputs[0]
    out = llm.generate(prompt_token_ids=prompt, sampling_params=SamplingParams(
        temperature=0, max_tokens=24, ignore_eos=True, logprobs=2, stop=stop))[0]
    c = out.outputs[0]
    assert c.finish_reason == "stop" and c.token_ids == full.token_ids[: i + 1]
    assert len(c.logprobs) == len(c.token_ids)
    for ea, eb in zip(full.logprobs, c.logprobs):
        assert list(eb) == list(ea) and list(eb.values()) == pytest.approx(list(ea.values()), abs=TOL)
    assert c.cumulative_logprob == pytest.approx(sum(e[t] for t, e in zip(c.token_ids, c.logprobs)), abs=1e-9)


def test_streamed_step_outputs_carry_aligned_growing_logprobs(spec_llms):
    """engine.step() outputs are cumulative: at every step the logprobs match token_ids one to one, and what was
    reported before is a prefix of what is reported after (a stream's deltas are the tails)."""
    engine = spec_llms["draft_model"].engine
    prompts = repetitive_prompts(2, seed=5)
    ids = [engine.add_request(prompt_token_ids=p, params=SamplingParams(
        temperature=0.8, max_tokens=14, ignore_eos=True, seed=i, logprobs=1)) for i, p in enumerate(prompts)]
    seen = {rid: [] for rid in ids}
    while engine.has_unfinished_requests():
        for out in engine.step():
            c = out.outputs[0]
            assert len(c.logprobs) == len(c.token_ids)
            assert c.logprobs[: len(seen[out.request_id])] == seen[out.request_id]
            seen[out.request_id] = c.logprobs
    assert all(len(v) == 14 for v in seen.values())


def test_no_logprobs_unless_asked(tiny_pair_plain):
    out = tiny_pair_plain.generate(prompt_token_ids=[1, 2, 3], sampling_params=SamplingParams(max_tokens=3, seed=0))[0]
    assert out.outputs[0].logprobs is None and out.outputs[0].cumulative_logprob is None


def test_token_logprobs_unit():
    """The module alone: rows repeat and differ in top_n; the dict's order is top-n, then the token."""
    logits = torch.tensor([[0.0, 2.0, 1.0, -1.0], [3.0, 0.0, 0.0, 1.0]])
    lp = torch.log_softmax(logits, -1)
    out = token_logprobs(logits, [0, 1, 0], [3, 0, 1], [2, 0, 1])
    assert list(out[0]) == [1, 2, 3] and out[0][3] == pytest.approx(lp[0, 3].item())
    assert out[1] == {0: pytest.approx(lp[1, 0].item())}
    assert list(out[2]) == [1] and out[2][1] == pytest.approx(lp[0, 1].item())
    assert token_logprobs(logits, [], [], []) == []


@pytest.mark.parametrize("value", [-1, 21, 2.0, True, "3"])
def test_bad_logprobs_are_refused(value):
    with pytest.raises(ValueError, match=r"SamplingParams\.logprobs=.*\[0, 20\]"):
        SamplingParams(logprobs=value)


def test_bad_logprobs_set_after_construction_are_refused_at_add_request(tiny_pair_plain):
    params = SamplingParams(max_tokens=2)
    params.logprobs = 50
    with pytest.raises(ValueError, match="logprobs"):
        tiny_pair_plain.generate(prompt_token_ids=[1, 2], sampling_params=params)
    assert not tiny_pair_plain.engine.has_unfinished_requests()
