"""Structured outputs over HTTP with the real ``openai`` client, on the default model (SmolLM2-135M-Instruct, fp32).

``response_format`` json_schema answers parse and validate against their schema, plain and with each speculative
method (a layer-skip draft model, prompt lookup, the n-gram table), and every greedy speculative answer equals
the plain one; a regex and a choice hold through ``guided_regex`` / ``structured_outputs``; streaming gives the
same text; ``json_object``; a bad schema is a 400 naming ``response_format``.
"""

from __future__ import annotations

import json
import re

import openai
import pytest
from helpers import make_layer_skip_draft
from serve_helpers import ServerThread

import specdec
from specdec.checkpoint.default_model import default_model_path

ENGINE = dict(dtype="float32", block_size=16, max_model_len=512, max_num_seqs=8)
PERSON = {"type": "object", "additionalProperties": False, "required": ["name", "age", "city"],
          "properties": {"name": {"type": "string"}, "age": {"type": "integer", "minimum": 0, "maximum": 150},
                         "city": {"type": "string"}}}
ASK = [{"role": "user", "content": "Describe Alice, who is 30 and lives in Paris, as a JSON object."}]


def valid_person(value) -> bool:
    return (isinstance(value, dict) and set(value) == {"name", "age", "city"} and isinstance(value["name"], str)
            and isinstance(value["city"], str) and isinstance(value["age"], int) and 0 <= value["age"] <= 150)


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    model = default_model_path()
    draft = make_layer_skip_draft(model, str(tmp_path_factory.mktemp("skip_draft")), 10)
    specs = {
        "plain": None,
        "draft_model": specdec.SpeculativeConfig(draft_model=draft, num_speculative_tokens=4),
        "prompt_lookup": specdec.SpeculativeConfig(method="prompt_lookup", num_speculative_tokens=4,
                                                   prompt_lookup_min=1),
        "ngram_table": specdec.SpeculativeConfig(method="ngram_table", num_speculative_tokens=4),
    }
    made = {name: ServerThread(model, name="smollm2", speculative=spec, **ENGINE).start()
            for name, spec in specs.items()}
    yield made
    for server in made.values():
        server.stop()


def schema_format(schema) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "person", "schema": schema, "strict": True}}


def test_json_schema_answers_validate_and_speculation_changes_nothing(servers):
    answers = {}
    for name, server in servers.items():
        got = server.client().chat.completions.create(model="smollm2", messages=ASK, temperature=0, max_tokens=80,
                                                      response_format=schema_format(PERSON))
        choice = got.choices[0]
        assert choice.finish_reason == "stop", (name, choice)
        assert valid_person(json.loads(choice.message.content)), (name, choice.message.content)
        answers[name] = choice.message.content
    assert len(set(answers.values())) == 1, answers  # greedy speculative == greedy plain, under the constraint


def test_regex_choice_json_object_and_streaming(servers):
    client = servers["prompt_lookup"].client()
    date = client.chat.completions.create(
        model="smollm2", temperature=0, max_tokens=20, messages=[{"role": "user", "content": "When was 1999?"}],
        extra_body={"guided_regex": r"[0-9]{4}-[0-9]{2}-[0-9]{2}"})
    assert re.fullmatch(r"[0-9]{4}-[0-9]{2}-[0-9]{2}", date.choices[0].message.content)
    colour = client.completions.create(model="smollm2", prompt="My favourite colour is", temperature=0.7, seed=1,
                                       max_tokens=10, extra_body={"structured_outputs": {"choice": ["red", "blue"]}})
    assert colour.choices[0].text in ("red", "blue")
    obj = client.chat.completions.create(model="smollm2", messages=ASK, temperature=0, max_tokens=60,
                                         response_format={"type": "json_object"})
    text = obj.choices[0].message.content  # any object: this model adds keys until max_tokens cuts it
    assert text.lstrip().startswith("{") and obj.choices[0].finish_reason in ("stop", "length")
    if obj.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(text), dict)
    stream = client.chat.completions.create(model="smollm2", messages=ASK, temperature=0, max_tokens=80,
                                            response_format=schema_format(PERSON), stream=True)
    text = "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices)
    whole = client.chat.completions.create(model="smollm2", messages=ASK, temperature=0, max_tokens=80,
                                           response_format=schema_format(PERSON))
    assert text == whole.choices[0].message.content and valid_person(json.loads(text))


def test_samples_and_logprobs_under_a_constraint(servers):
    """n = 3 seeded samples each obey the choice; logprobs come back for every token of each."""
    got = servers["draft_model"].client().chat.completions.create(
        model="smollm2", messages=[{"role": "user", "content": "Pick a colour."}], temperature=1.0, seed=5, n=3,
        max_tokens=10, logprobs=True, top_logprobs=2,
        extra_body={"structured_outputs": {"choice": ["red", "green", "blue"]}})
    assert len(got.choices) == 3
    for choice in got.choices:
        assert choice.message.content in ("red", "green", "blue") and choice.finish_reason == "stop"
        assert choice.logprobs.content and all(len(t.top_logprobs) == 2 for t in choice.logprobs.content)


def test_the_default_dtype_answers_validate(tmp_path_factory):
    """The default dtype (``dtype="auto"``: bf16 on CPUs with native bf16): answers still parse and validate, plain
    and with prompt lookup (token identity between them is not claimed there: docs/guarantees.md)."""
    model = default_model_path()
    for spec in (None, specdec.SpeculativeConfig(method="prompt_lookup", num_speculative_tokens=4)):
        server = ServerThread(model, name="smollm2", speculative=spec, max_model_len=512, max_num_seqs=2).start()
        try:
            got = server.client().chat.completions.create(model="smollm2", messages=ASK, temperature=0,
                                                          max_tokens=80, response_format=schema_format(PERSON))
            assert got.choices[0].finish_reason == "stop", got.choices[0]
            assert valid_person(json.loads(got.choices[0].message.content))
        finally:
            server.stop()


def test_a_cut_answer_is_length_and_a_bad_schema_is_400(servers):
    client = servers["plain"].client()
    cut = client.chat.completions.create(model="smollm2", messages=ASK, temperature=0, max_tokens=5,
                                         response_format=schema_format(PERSON))
    assert cut.choices[0].finish_reason == "length"
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="smollm2", messages=ASK, max_tokens=5,
                                       response_format=schema_format({"type": "objectx"}))
    error = e.value.response.json()["error"]
    assert error["param"] == "response_format" and "response_format.json_schema.schema" in error["message"], error
    assert "objectx" in error["message"]
