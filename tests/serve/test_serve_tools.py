"""Tool calls over HTTP with the real ``openai`` client.

On the default model (SmolLM2, whose template has no tools section: the generic format): ``tool_choice``
"required" and a named function give a parsed call of an allowed tool whose arguments follow its schema, streamed
and not; the call and the tool's result sent back give a final answer (the round trip). On a tiny model with a
Qwen2.5-style template (``<tool_call>`` tags, tools rendered by the template): "required" gives a parsed call.
Parsing of each format (hermes, Llama 3 JSON, generic) and the 400s for bad ``tools`` / ``tool_choice``.
"""

from __future__ import annotations

import json
import os
import shutil

import openai
import pytest
from serve_helpers import ServerThread

from specdec.checkpoint.default_model import default_model_path
from specdec.tool_calls import call_constraint, parse_calls, render_messages, tool_format

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The current weather in a city.",
    "parameters": {"type": "object", "additionalProperties": False, "required": ["city"],
                   "properties": {"city": {"type": "string"}, "unit": {"enum": ["celsius", "fahrenheit"]}}}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "description": "The local time in a city.",
    "parameters": {"type": "object", "additionalProperties": False, "required": ["city"],
                   "properties": {"city": {"type": "string"}}}}}
ASK = [{"role": "user", "content": "What is the weather in Paris right now?"}]
HERMES_TEMPLATE = (
    "{% if tools %}<|system|>Tools:{% for t in tools %} {{ t['function']['name'] }}{% endfor %}\n{% endif %}"
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] or '' }}"
    "{% if m.get('tool_calls') %}<tool_call>{{ m['tool_calls'][0]['function'] | tojson }}</tool_call>{% endif %}"
    "\n{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


@pytest.fixture(scope="module")
def smollm2():
    server = ServerThread(default_model_path(), name="smollm2", dtype="float32", max_model_len=1024,
                          max_num_seqs=4).start()
    yield server
    server.stop()


@pytest.fixture(scope="module")
def hermes(tiny_pair, tmp_path_factory):
    folder = str(tmp_path_factory.mktemp("hermes"))
    for name in os.listdir(tiny_pair[0]):
        shutil.copy(os.path.join(tiny_pair[0], name), folder)
    with open(os.path.join(folder, "tokenizer_config.json")) as f:
        cfg = json.load(f)
    cfg["chat_template"] = HERMES_TEMPLATE
    with open(os.path.join(folder, "tokenizer_config.json"), "w") as f:
        json.dump(cfg, f)
    server = ServerThread(folder, dtype="float32", block_size=4, max_model_len=512).start()
    yield server
    server.stop()


def weather_args(call) -> dict:
    assert call.type == "function" and call.function.name == "get_weather", call
    args = json.loads(call.function.arguments)
    assert isinstance(args.get("city"), str) and set(args) <= {"city", "unit"}, args
    return args


def test_required_call_round_trip_on_the_default_model(smollm2):
    client = smollm2.client()
    got = client.chat.completions.create(model="smollm2", messages=ASK, tools=[WEATHER, TIME], temperature=0,
                                         tool_choice="required", max_tokens=80)
    choice = got.choices[0]
    assert choice.finish_reason == "tool_calls" and len(choice.message.tool_calls) == 1, choice
    call = choice.message.tool_calls[0]
    assert call.function.name in ("get_weather", "get_time") and call.id.startswith("call_")
    assert isinstance(json.loads(call.function.arguments)["city"], str)
    history = ASK + [{"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
                     {"role": "tool", "tool_call_id": call.id, "content": json.dumps({"temperature_c": 21})}]
    final = client.chat.completions.create(model="smollm2", messages=history, tools=[WEATHER, TIME],
                                           tool_choice="none", temperature=0, max_tokens=40)
    assert final.choices[0].message.content and not final.choices[0].message.tool_calls


def test_named_call_streamed_equals_non_streamed(smollm2):
    client = smollm2.client()
    named = {"type": "function", "function": {"name": "get_weather"}}
    whole = client.chat.completions.create(model="smollm2", messages=ASK, tools=[WEATHER, TIME], temperature=0,
                                           tool_choice=named, max_tokens=80)
    args = weather_args(whole.choices[0].message.tool_calls[0])
    stream = client.chat.completions.create(model="smollm2", messages=ASK, tools=[WEATHER, TIME], temperature=0,
                                            tool_choice=named, max_tokens=80, stream=True)
    name, pieces, finish = None, [], None
    for chunk in stream:
        for c in chunk.choices:
            for tc in c.delta.tool_calls or []:
                name = tc.function.name or name
                pieces.append(tc.function.arguments or "")
            finish = c.finish_reason or finish
    assert name == "get_weather" and json.loads("".join(pieces)) == args and finish == "tool_calls"


def test_required_call_in_the_hermes_format(hermes):
    """A random tiny model: the tool's arguments are enums, so the constrained call ends within max_tokens."""
    bounded = {"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "additionalProperties": False, "required": ["city"],
        "properties": {"city": {"enum": ["Paris", "Oslo"]}, "unit": {"enum": ["celsius", "fahrenheit"]}}}}}
    got = hermes.client().chat.completions.create(model="tiny", messages=ASK, tools=[bounded], temperature=0,
                                                  tool_choice="required", max_tokens=120)
    choice = got.choices[0]
    assert choice.finish_reason == "tool_calls", choice
    assert weather_args(choice.message.tool_calls[0])["city"] in ("Paris", "Oslo")


@pytest.mark.parametrize("fields,param", [
    ({"tools": [{"type": "function"}]}, "tools"),
    ({"tools": [WEATHER, WEATHER]}, "tools"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": [WEATHER], "tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice"),
    ({"messages": [{"role": "user", "content": None}]}, "messages[0].content"),
])
def test_bad_tools_answer_400_naming_the_field(hermes, fields, param):
    body = {"model": "tiny", "messages": ASK, "max_tokens": 4, **fields}
    with pytest.raises(openai.BadRequestError) as e:
        hermes.client().chat.completions.create(**body)
    assert e.value.response.json()["error"]["param"] == param


# --- the formats, without a model ----------------------------------------------------------------------------
def test_formats_are_picked_from_the_template():
    assert tool_format(HERMES_TEMPLATE) == "hermes"
    assert tool_format("{{ '<|python_tag|>' }}") == "llama3_json"
    assert tool_format(None) == tool_format("{{ messages }}") == "generic"


def test_parsing_each_format():
    text = ('Let me check.<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'
            '<tool_call>{"name": "get_time", "arguments": {"city": "Oslo"}}</tool_call>')
    content, calls = parse_calls(text, "hermes", [WEATHER, TIME])
    assert content == "Let me check." and [c["function"]["name"] for c in calls] == ["get_weather", "get_time"]
    assert json.loads(calls[0]["function"]["arguments"]) == {"city": "Oslo"}
    content, calls = parse_calls('{"name": "get_weather", "parameters": {"city": "Rome"}}', "llama3_json", [WEATHER])
    assert content is None and json.loads(calls[0]["function"]["arguments"]) == {"city": "Rome"}
    for text in ('{"name": "unknown", "arguments": {}}', "It is sunny.", '{"name": "get_weather", "arguments": 3}',
                 "<tool_call>{not json}</tool_call>"):
        for fmt in ("hermes", "generic"):
            assert parse_calls(text, fmt, [WEATHER]) == (text, [])  # not a call of a given tool: text


def test_constraints_and_generic_rendering():
    assert call_constraint([WEATHER], "auto", "generic") is None
    one = call_constraint([WEATHER, TIME], {"type": "function", "function": {"name": "get_time"}}, "generic")
    assert one.json["properties"]["name"] == {"const": "get_time"}
    both = call_constraint([WEATHER, TIME], "required", "llama3_json")
    assert [o["required"] for o in both.json["anyOf"]] == [["name", "parameters"]] * 2
    assert call_constraint([WEATHER], "required", "hermes").grammar.startswith('start: "<tool_call>')
    call = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "X"}'}}
    rendered = render_messages(ASK + [{"role": "assistant", "content": None, "tool_calls": [call]},
                                      {"role": "tool", "tool_call_id": "call_1", "content": "21C"}], [WEATHER],
                               "generic")
    assert rendered[0]["role"] == "system" and "get_weather" in rendered[0]["content"]
    assert json.loads(rendered[2]["content"]) == {"name": "get_weather", "arguments": {"city": "X"}}
    assert rendered[3] == {"role": "tool", "content": "21C"}


def test_hermes_tags_as_special_tokens():
    """Qwen2.5's <tool_call> tags are special tokens: the detokenised answer has none (calls are bare JSON lines),
    and the constraint references the tag tokens by id (a text literal would never match them)."""
    content, calls = parse_calls('{"name": "get_weather", "arguments": {"city": "Oslo"}}\n'
                                 '{"name": "get_time", "arguments": {"city": "Oslo"}}', "hermes", [WEATHER, TIME])
    assert content is None and [c["function"]["name"] for c in calls] == ["get_weather", "get_time"]
    mixed = '{"name": "get_weather", "arguments": {"city": "Oslo"}}\nIt is sunny.'
    assert parse_calls(mixed, "hermes", [WEATHER]) == (mixed, [])
    grammar = call_constraint([WEATHER], "required", "hermes", (151657, 151658)).grammar
    assert grammar.startswith('start: <[151657]> "\\n" call "\\n" <[151658]>')
    call = {"id": "c", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "X"}'}}
    rendered = render_messages([{"role": "assistant", "content": None, "tool_calls": [call]}], [WEATHER], "hermes")
    assert rendered[0]["tool_calls"][0]["function"]["arguments"] == {"city": "X"}  # an object, for the template
