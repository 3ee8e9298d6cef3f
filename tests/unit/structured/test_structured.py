"""Structured outputs: the constraint's shape checks, grammar compilation and its errors, the matcher's masks along
drafts, and the engine end to end on a tiny model (a regex, a choice, a JSON schema, n > 1, max_tokens, bad
constraints refused before anything is queued)."""

from __future__ import annotations

import json
import re

import numpy as np
import pytest
from helpers import small_llm
from tiny_models import byte_tokenizer_json

from specdec import SamplingParams, SpeculativeConfig
from specdec.structured.grammar import GrammarCompiler
from specdec.structured.params import StructuredOutputsParams

VOCAB = 300  # tiny_models' model vocabulary; the byte tokenizer has 262 tokens, eos 261
EOS = 261


@pytest.fixture(scope="module")
def compiler():
    return GrammarCompiler(byte_tokenizer_json(), VOCAB, [EOS], 262)


def ids(text: str) -> list[int]:
    from tokenizers import Tokenizer

    return Tokenizer.from_str(byte_tokenizer_json()).encode(text).ids


# --- the constraint's shape -------------------------------------------------------------------------------------
@pytest.mark.parametrize("kwargs,message", [
    ({}, "exactly one of"),
    ({"regex": "a", "choice": ["a"]}, "exactly one of"),
    ({"json": 3}, "JSON schema"),
    ({"json": "{not json"}, "not valid JSON"),
    ({"regex": ""}, "non-empty string"),
    ({"choice": []}, "non-empty list"),
    ({"choice": ["a", 3]}, "non-empty list"),
    ({"json_object": "yes"}, "true or false"),
    ({"regex": "a+", "disable_any_whitespace": True}, "json and json_object only"),
])
def test_bad_constraints_say_what_is_wrong(kwargs, message):
    with pytest.raises(ValueError, match=message):
        StructuredOutputsParams(**kwargs)


def test_from_dict_and_sampling_params_accept_vllms_shape():
    params = SamplingParams(structured_outputs={"choice": ["yes", "no"]})
    assert isinstance(params.structured_outputs, StructuredOutputsParams)
    assert params.structured_outputs.choice == ("yes", "no") and params.needs_host_drafts
    assert not SamplingParams().needs_host_drafts
    with pytest.raises(ValueError, match="whitespace_pattern not supported"):
        StructuredOutputsParams.from_dict({"json": {}, "whitespace_pattern": " "})
    with pytest.raises(ValueError, match="structured_outputs"):
        SamplingParams(structured_outputs=["regex"])
    same = StructuredOutputsParams(json={"b": 1, "a": 2}).key()
    assert same == StructuredOutputsParams(json={"a": 2, "b": 1}).key()  # one cache entry for one schema


# --- compiling ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("kwargs,message", [
    ({"json": {"type": "objectx"}}, r"structured_outputs\.json is not usable: .*objectx"),
    ({"regex": "[a-"}, r"structured_outputs\.regex is not usable: .*regex"),
    ({"grammar": "start: missing_rule"}, r"structured_outputs\.grammar is not usable"),
])
def test_unusable_grammars_are_refused_naming_the_problem(compiler, kwargs, message):
    with pytest.raises(ValueError, match=message):
        compiler.compile(StructuredOutputsParams(**kwargs))


def test_compiled_grammars_are_cached_per_constraint(compiler):
    first = compiler.compile(StructuredOutputsParams(regex="(ab)+"))
    assert compiler.compile(StructuredOutputsParams(regex="(ab)+")) is first
    assert compiler.compile(StructuredOutputsParams(regex="(ab)*")) != first


def test_no_eos_in_range_is_refused():
    with pytest.raises(ValueError, match="eos token id"):
        GrammarCompiler(byte_tokenizer_json(), VOCAB, [5000], 262)


# --- masks along drafts -------------------------------------------------------------------------------------------
def test_masks_along_drafts_equal_step_by_step_masks_and_leave_the_matcher_where_it_was(compiler):
    state = compiler.state(StructuredOutputsParams(regex="abc(d|e)f"))
    drafts = ids("abcdf")
    rows = state.allowed_along(drafts)
    reference = compiler.state(StructuredOutputsParams(regex="abc(d|e)f"))
    for j, token in enumerate(drafts):
        assert np.array_equal(rows[j], reference.allowed())
        reference.accept(token)
    assert np.array_equal(state.allowed(), rows[0])  # rolled back
    assert rows[3][ids("d")[0]] and rows[3][ids("e")[0]] and rows[3].sum() == 2
    assert not rows[0][VOCAB - 1]  # ids beyond the tokenizer are never allowed


def test_a_refused_draft_leaves_the_rows_after_it_unconstrained_and_the_matcher_usable(compiler):
    state = compiler.state(StructuredOutputsParams(regex="abcdef"))
    rows = state.allowed_along(ids("abxde"))  # x refused at row 2
    assert rows[2].sum() == 1 and rows[2][ids("c")[0]]
    assert rows[3:].all()
    for token in ids("abc"):  # a refused draft did not break the request's own matcher
        state.accept(token)
    with pytest.raises(ValueError, match="outside the request's grammar"):
        state.accept(ids("x")[0])
    assert state.valid_prefix(ids("def")) == 3


# --- the engine ----------------------------------------------------------------------------------------------------
def greedy(**kw):
    return SamplingParams(temperature=0, ignore_eos=True, **kw)


@pytest.mark.parametrize("spec", [None, {"method": "prompt_lookup", "num_speculative_tokens": 3,
                                         "prompt_lookup_min": 1}, "draft"], ids=["plain", "prompt_lookup", "draft"])
def test_outputs_obey_regex_choice_and_schema(tiny_pair, spec):
    if spec == "draft":
        spec = {"draft_model": tiny_pair[1], "num_speculative_tokens": 3}
    llm = small_llm(tiny_pair[0], dtype="float32", block_size=4, max_model_len=256,
                    speculative=SpeculativeConfig(**spec) if spec else None)
    schema = {"type": "object", "required": ["c", "n"], "additionalProperties": False,
              "properties": {"c": {"enum": ["red", "blue"]}, "n": {"type": "integer", "minimum": 0, "maximum": 99}}}
    params = [greedy(max_tokens=40, structured_outputs={"regex": "[a-c]{3}-[0-9]{2}"}),
              greedy(max_tokens=40, structured_outputs={"choice": ["the cat", "an ant", "tin"]}),
              greedy(max_tokens=60, structured_outputs={"json": schema, "disable_any_whitespace": True}),
              SamplingParams(temperature=0.9, seed=3, max_tokens=40, n=3, ignore_eos=True,
                             structured_outputs={"regex": "(ab|cd){2,4}"})]
    outs = llm.generate(["the cat sat", "in the tin", "hello", "an ant"], params)
    assert all(o.error is None for o in outs), [o.error for o in outs]
    assert re.fullmatch(r"[a-c]{3}-[0-9]{2}", outs[0].outputs[0].text)
    assert outs[1].outputs[0].text in ("the cat", "an ant", "tin")
    value = json.loads(outs[2].outputs[0].text)
    assert set(value) == {"c", "n"} and value["c"] in ("red", "blue") and isinstance(value["n"], int)
    assert len(outs[3].outputs) == 3  # every sample its own matcher
    assert all(re.fullmatch(r"(ab|cd){2,4}", c.text) for c in outs[3].outputs), [c.text for c in outs[3].outputs]
    assert all(c.finish_reason == "stop" for o in outs[:3] for c in o.outputs)  # the grammar completed


def test_a_constrained_answer_cut_by_max_tokens_ends_with_length(tiny_pair):
    llm = small_llm(tiny_pair[0], dtype="float32", block_size=4, max_model_len=256)
    out = llm.generate(["hi"], greedy(max_tokens=5, structured_outputs={"regex": "[a-z]{20}"}))[0].outputs[0]
    assert out.finish_reason == "length" and re.fullmatch(r"[a-z]{5}", out.text)


def test_a_bad_constraint_is_refused_before_anything_is_queued(tiny_pair):
    llm = small_llm(tiny_pair[0], dtype="float32", block_size=4, max_model_len=256)
    with pytest.raises(ValueError, match="structured_outputs.json is not usable"):
        llm.generate(["hi"], greedy(max_tokens=5, structured_outputs={"json": {"type": "objectx"}}))
    assert not llm.engine.has_unfinished_requests()


def test_an_eos_draft_is_not_consumed_so_the_matcher_stays_usable(compiler):
    """A matcher that consumed eos is stopped and a rollback does not restore it (a draft model drafted eos after a
    completed choice and the request's matcher then refused every token): the walk stops before eos."""
    state = compiler.state(StructuredOutputsParams(choice=["ab", "cd"]))
    before = state.allowed()
    rows = state.allowed_along(ids("ab") + [EOS, EOS])
    assert rows[2][EOS] and rows[3:].all()  # eos allowed after "ab"; the rows after the eos draft unconstrained
    assert np.array_equal(state.allowed(), before)
    for token in ids("ab"):
        state.accept(token)
    assert state.finished


def test_forced_text_is_drafted_for_free_and_changes_no_token(tiny_pair):
    """A regex with long literal stretches, through prompt lookup on prompts it finds nothing in: the only drafts
    are the grammar's forced tokens; they are accepted, and the greedy tokens equal plain decoding's."""
    regex = "the (cat|ant) sat on the (mat|tin) in the [a-z]{3} house"
    params = greedy(max_tokens=60, structured_outputs={"regex": regex})
    prompts = [[5, 9, 77, 3], [120, 14, 8, 61, 2]]  # nothing repeats: prompt lookup (min 3) matches nothing
    plain = small_llm(tiny_pair[0], dtype="float32", block_size=4, max_model_len=256)
    spec = small_llm(tiny_pair[0], dtype="float32", block_size=4, max_model_len=256,
                     speculative=SpeculativeConfig(method="prompt_lookup", num_speculative_tokens=4,
                                                   prompt_lookup_min=3))
    expected = [o.outputs[0] for o in plain.generate(prompt_token_ids=prompts, sampling_params=params)]
    outs = spec.generate(prompt_token_ids=prompts, sampling_params=params)
    assert [o.outputs[0].token_ids for o in outs] == [e.token_ids for e in expected]
    assert all(re.fullmatch(regex, o.outputs[0].text) for o in outs), [o.outputs[0].text for o in outs]
    drafted = sum(o.metrics["drafted"] for o in outs)
    accepted = sum(o.metrics["accepted"] for o in outs)
    assert accepted > 0 and drafted >= accepted
    steps = sum(o.metrics["target_forwards"] for o in outs)
    assert steps < sum(len(e.token_ids) for e in expected)  # fewer target forwards than tokens: free drafts paid


def test_combined_drafting_with_constrained_lookup_hits_beside_unconstrained_misses(tiny_pair, monkeypatch):
    """``method="combined"``: constrained requests drafted by the lookup, unconstrained ones by the draft model (whose
    drafts then stay on the device): the grammar's masks still get every draft on the host - no failed step retried
    request by request - and the greedy tokens equal plain decoding's."""
    constrained = greedy(max_tokens=16, structured_outputs={"regex": "[^\\x00]{16}"})
    free = greedy(max_tokens=16)
    prompts = [[5, 6, 7, 8] * 5, [9, 10, 11] * 6, [120, 3, 77, 41], [200, 13, 8]]
    params = [constrained, constrained, free, free]
    plain = small_llm(tiny_pair[0], dtype="float32", block_size=4, max_model_len=256)
    expected = [o.outputs[0].token_ids for o in plain.generate(prompt_token_ids=prompts, sampling_params=params)]
    llm = small_llm(tiny_pair[0], dtype="float32", block_size=4, max_model_len=256,
                    speculative=SpeculativeConfig(method="combined", draft_model=tiny_pair[1],
                                                  num_speculative_tokens=3, prompt_lookup_min=2))
    retried = []
    isolated = llm.engine._compute_isolated

    def spy(batch, retry=False):
        retried.append(retry)
        return isolated(batch, retry)

    monkeypatch.setattr(llm.engine, "_compute_isolated", spy)
    outs = llm.generate(prompt_token_ids=prompts, sampling_params=params)
    assert [o.outputs[0].token_ids for o in outs] == expected
    assert not any(retried), "a step failed and was retried request by request"
    assert sum(o.metrics["accepted"] for o in outs) > 0
