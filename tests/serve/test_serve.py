"""The OpenAI-compatible server against the real ``openai`` client, served in-process on 127.0.0.1 (a free port).

References come from ``specdec.LLM`` on the same tiny checkpoint: greedy output must equal target-only greedy
decoding, a seeded request the library's output for the same seed, a stream the non-streamed text.
"""

from __future__ import annotations

import asyncio
import json
import time

import openai
import pytest
from helpers import small_llm
from prometheus_client.parser import text_string_to_metric_families
from serve_helpers import Http, ServerThread

import specdec
from specdec.serve.app import build_app

ENGINE = dict(dtype="float32", block_size=4, max_model_len=256, num_kv_blocks=800, max_num_seqs=48)
PROMPTS = ["the cat sat on", "in the beginning", "hello there, the", "an ant in the tin"]


@pytest.fixture(scope="module")
def servers(tiny_pair):
    target, draft = tiny_pair
    made = {
        "plain": ServerThread(target, **ENGINE),
        "ngram": ServerThread(target, speculative=specdec.SpeculativeConfig(method="ngram_table",
                                                                            num_speculative_tokens=3), **ENGINE),
        "draft": ServerThread(target, speculative=specdec.SpeculativeConfig(
            method="draft_model", draft_model=draft, num_speculative_tokens=3), **ENGINE),
    }
    for s in made.values():
        s.start()
    yield made
    for s in made.values():
        s.stop()


@pytest.fixture(scope="module")
def references(tiny_pair):
    """LLMs configured like each server (outside it), for the seeded-sampling references."""
    target, draft = tiny_pair
    return {
        "plain": small_llm(target, **ENGINE),
        "ngram": small_llm(target, speculative=specdec.SpeculativeConfig(method="ngram_table",
                                                                          num_speculative_tokens=3), **ENGINE),
        "draft": small_llm(target, speculative=specdec.SpeculativeConfig(
            method="draft_model", draft_model=draft, num_speculative_tokens=3), **ENGINE),
    }


KINDS = ["plain", "ngram", "draft"]


@pytest.mark.parametrize("kind", KINDS)
def test_greedy_completion_and_chat_equal_llm(servers, tiny_pair_plain, kind):
    """Greedy over HTTP (speculative or not) is token-identical to target-only greedy ``LLM.generate``/``chat``."""
    server = servers[kind]
    client = server.client()
    for prompt in PROMPTS[:2]:
        ref = tiny_pair_plain.generate(prompt, specdec.SamplingParams(temperature=0, max_tokens=24))[0]
        got = client.completions.create(model="tiny", prompt=prompt, max_tokens=24, temperature=0)
        assert got.choices[0].text == ref.outputs[0].text
        assert got.choices[0].finish_reason == ref.outputs[0].finish_reason
        assert got.usage.prompt_tokens == len(ref.prompt_token_ids)
        assert got.usage.completion_tokens == len(ref.outputs[0].token_ids)
        assert got.usage.total_tokens == got.usage.prompt_tokens + got.usage.completion_tokens
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "the cat"}]
    ref = tiny_pair_plain.chat(messages, specdec.SamplingParams(temperature=0, max_tokens=20))[0]
    got = client.chat.completions.create(model="tiny", messages=messages, max_tokens=20, temperature=0)
    assert got.choices[0].message.content == ref.outputs[0].text
    assert got.choices[0].message.role == "assistant"
    assert got.usage.prompt_tokens == len(ref.prompt_token_ids)
    assert got.usage.completion_tokens == len(ref.outputs[0].token_ids)


@pytest.mark.parametrize("kind", KINDS)
def test_stream_equals_non_stream_and_seeded_llm(servers, references, kind):
    """A seeded sampled request: streamed deltas add up to the non-streamed text, which equals ``LLM.generate``
    for the same seed; the final streamed chunk carries the same usage."""
    server, client = servers[kind], servers[kind].client()
    args = dict(model="tiny", max_tokens=30, temperature=0.9, top_p=0.95, seed=11)
    # the first request computes the prompt, the second finds it in the prefix cache: same tokens either way
    full = client.completions.create(prompt=PROMPTS[2], **args)
    chunks = list(client.completions.create(prompt=PROMPTS[2], stream=True, stream_options={"include_usage": True},
                                            **args))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == full.choices[0].text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == full.choices[0].finish_reason
    usage = chunks[-1].usage  # the same counts (the streamed request found the prompt cached: cached_tokens differ)
    assert chunks[-1].choices == [] and (usage.prompt_tokens, usage.completion_tokens, usage.total_tokens) == (
        full.usage.prompt_tokens, full.usage.completion_tokens, full.usage.total_tokens)
    ref = references[kind].generate(PROMPTS[2], specdec.SamplingParams(temperature=0.9, top_p=0.95, seed=11,
                                                                       max_tokens=30))[0]
    assert full.choices[0].text == ref.outputs[0].text
    messages = [{"role": "user", "content": "tell me about the tin"}]
    full = client.chat.completions.create(messages=messages, **args)
    chunks = list(client.chat.completions.create(messages=messages, stream=True, **args))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == full.choices[0].message.content
    assert chunks[-1].choices[0].finish_reason == full.choices[0].finish_reason
    assert server.wait_idle()["free"] == server.wait_idle()["total"]


def _mixed_params(i: int) -> dict:
    """32 different requests: greedy and sampled, penalties, top-k/min-p, stop strings, lengths."""
    base = dict(max_tokens=8 + (i * 7) % 33, seed=1000 + i)
    variants = [
        dict(temperature=0),
        dict(temperature=0.8, top_p=0.9),
        dict(temperature=1.0, extra_body={"top_k": 20}),
        dict(temperature=0.7, presence_penalty=0.5, frequency_penalty=0.3),
        dict(temperature=1.2, extra_body={"min_p": 0.05, "repetition_penalty": 1.2}),
        dict(temperature=0.6, stop=["e", "\n"]),
    ]
    return {**base, **variants[i % len(variants)]}


def _as_sampling(kw: dict) -> specdec.SamplingParams:
    fields = {k: v for k, v in kw.items() if k != "extra_body"}
    fields.update(kw.get("extra_body", {}))
    return specdec.SamplingParams(**fields)


@pytest.mark.parametrize("kind", ["plain", "draft"])
def test_32_concurrent_streams(servers, references, kind):
    """32 streaming clients at once with mixed parameters: every stream completes with a consistent finish reason
    and usage, equals the library's output for the same request, and afterwards every KV block of every pool is
    free again."""
    server = servers[kind]
    requests = [(PROMPTS[i % len(PROMPTS)] + " " * (i % 3), _mixed_params(i)) for i in range(32)]

    async def one(client, prompt, kw):
        stream = await client.completions.create(model="tiny", prompt=prompt, stream=True,
                                                 stream_options={"include_usage": True}, **kw)
        text, reason, usage = "", None, None
        async for chunk in stream:
            if chunk.choices:
                text += chunk.choices[0].text
                reason = chunk.choices[0].finish_reason or reason
            usage = chunk.usage or usage
        return text, reason, usage.completion_tokens

    async def run_all():
        client = server.async_client()
        try:
            return await asyncio.wait_for(asyncio.gather(*(one(client, p, kw) for p, kw in requests)), 120)
        finally:
            await client.close()

    results = asyncio.run(run_all())
    refs = references[kind].generate([p for p, _ in requests], [_as_sampling(kw) for _, kw in requests])
    for (text, reason, tokens), ref, (_, kw) in zip(results, refs, requests):
        assert reason in ("stop", "length") and 1 <= tokens <= kw["max_tokens"]
        assert reason == "stop" or tokens == kw["max_tokens"]
        assert not any(stop in text for stop in kw.get("stop", []))
        # seeded: the same tokens whatever the batch and whichever requests hit the prefix cache (fixed k, no
        # pool pressure: docs/guarantees.md)
        assert (text, reason, tokens) == (ref.outputs[0].text, ref.outputs[0].finish_reason,
                                          len(ref.outputs[0].token_ids))
    state = server.wait_idle()
    assert not state["unfinished"] and state["free"] == state["total"], state
    assert state["pools"] == (2 if kind == "draft" else 1)


def test_disconnect_mid_stream_frees_blocks(servers):
    """A client that leaves mid-stream aborts its request: its blocks are free at once, the server serves on."""
    server = servers["draft"]
    body = {"model": "tiny", "prompt": "the cat", "max_tokens": 240, "temperature": 0.8, "stream": True,
            "ignore_eos": True}
    conn, response = Http(server).stream("/v1/completions", body)
    try:
        assert response.status == 200
        seen = [e for e, _ in zip(Http.events(response), range(3))]
        assert len(seen) == 3 and server.engine_state()["unfinished"]  # it is running when the client leaves
    finally:
        conn.close()
    state = server.wait_idle()
    assert not state["unfinished"] and state["free"] == state["total"], state
    metrics = Http(server).get("/metrics")[1]
    assert _sample(metrics, "specdec_requests_finished_total", {"finish_reason": "abort"}) >= 1
    got = server.client().completions.create(model="tiny", prompt="the", max_tokens=4, temperature=0)
    assert got.choices[0].finish_reason in ("length", "stop")


def test_disconnect_while_waiting_for_a_non_streamed_response_aborts(servers):
    """A non-streamed request whose client leaves before the answer is aborted too (not run to completion)."""
    server = servers["plain"]
    metrics = lambda: _sample(Http(server).get("/metrics")[1], "specdec_requests_finished_total",  # noqa: E731
                              {"finish_reason": "abort"}, default=0)
    before = metrics()
    conn, _ = Http(server).open("/v1/completions", {"model": "tiny", "prompt": "a tin", "max_tokens": 240,
                                                     "ignore_eos": True})
    deadline = time.monotonic() + 20
    while not server.engine_state()["unfinished"] and time.monotonic() < deadline:
        time.sleep(0.01)
    conn.close()  # leave without reading the answer
    state = server.wait_idle()
    assert not state["unfinished"] and state["free"] == state["total"], state
    assert metrics() == before + 1


def test_idle_loop_does_not_step(servers):
    """With nothing to do the engine loop blocks on its command queue: no step runs until a request arrives."""
    server = servers["plain"]
    server.wait_idle()
    engine = server.llm.engine
    calls = []
    step = engine.step

    def counting_step():
        calls.append(1)
        return step()

    server.async_engine.call_sync(lambda e: setattr(e, "step", counting_step))
    try:
        time.sleep(0.3)
        assert calls == []
        server.client().completions.create(model="tiny", prompt="the", max_tokens=3, temperature=0)
        assert 1 <= len(calls) <= 4 + 1  # prefill + decodes (+ at most one flush of an abort)
        n = len(calls)
        time.sleep(0.3)
        assert len(calls) == n
    finally:
        server.async_engine.call_sync(lambda e: e.__dict__.pop("step", None))


def test_queue_full_answers_503_then_serves(tiny_pair):
    """max_num_seqs 1 + max_waiting 0: a second request while one runs gets 503 with Retry-After."""
    server = ServerThread(tiny_pair[0], max_waiting=0, **{**ENGINE, "max_num_seqs": 1}).start()
    try:
        body = {"model": "tiny", "prompt": "the cat", "max_tokens": 240, "stream": True, "ignore_eos": True}
        http = Http(server)
        conn, response = http.stream("/v1/completions", body)
        try:
            next(Http.events(response))
            status, headers, error = http.post("/v1/completions", {"model": "tiny", "prompt": "x", "max_tokens": 2})
            assert status == 503
            assert headers["retry-after"] == "1"
            assert error["error"]["code"] == "queue_full"
            with pytest.raises(openai.InternalServerError) as e:  # the openai client sees the same
                server.client().completions.create(model="tiny", prompt="x", max_tokens=2)
            assert e.value.status_code == 503
        finally:
            conn.close()
        server.wait_idle()
        got = server.client().completions.create(model="tiny", prompt="x", max_tokens=3, temperature=0)
        assert got.usage.completion_tokens >= 1
    finally:
        server.stop()


BAD = [
    ("completions", {"top_p": 2}, "top_p"),
    ("completions", {"temperature": -1}, "temperature"),
    ("completions", {"max_tokens": 0}, "max_tokens"),
    ("completions", {"presence_penalty": 3}, "presence_penalty"),
    ("completions", {"seed": -1}, "seed"),
    ("completions", {"stop": [""]}, "stop"),
    ("completions", {"n": 0}, "n"),
    ("completions", {"logprobs": 50}, "logprobs"),
    ("completions", {"echo": True}, "echo"),
    ("completions", {"logit_bias": {"5": 10}}, "logit_bias"),
    ("completions", {"extra_body": {"top_k": -3}}, "top_k"),
    ("completions", {"extra_body": {"repetition_penalty": 0}}, "repetition_penalty"),
    ("completions", {"prompt": "the " * 300}, "prompt"),  # over max_model_len
    ("completions", {"prompt": ""}, "prompt"),
    ("chat", {"tools": [{"type": "function", "function": {"name": "no spaces"}}]}, "tools"),
    ("chat", {"max_completion_tokens": -1}, "max_completion_tokens"),
    ("chat", {"top_logprobs": 3}, "top_logprobs"),
    ("chat", {"messages": [{"role": "user", "content": "the " * 300}]}, "messages"),
    ("chat", {"messages": [{"role": "user"}]}, "messages[0].content"),
    ("chat", {"response_format": {"type": "xml"}}, "response_format"),
    ("chat", {"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format"),
    ("chat", {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "objectx"}}}},
     "response_format"),
    ("completions", {"extra_body": {"guided_regex": "[a-"}}, "guided_regex"),
    ("completions", {"extra_body": {"guided_choice": []}}, "guided_choice"),
    ("chat", {"extra_body": {"structured_outputs": {"regex": "a", "choice": ["a"]}}}, "structured_outputs"),
    ("chat", {"extra_body": {"structured_outputs": {"json": {}, "whitespace_pattern": " "}}}, "structured_outputs"),
    ("chat", {"response_format": {"type": "json_object"}, "extra_body": {"guided_regex": "a+"}}, "guided_regex"),
]


@pytest.mark.parametrize("endpoint,fields,param", BAD, ids=[b[2] + "-" + b[0] for b in BAD])
def test_bad_field_answers_400_naming_it(servers, endpoint, fields, param):
    client = servers["plain"].client()
    fields = dict(fields)
    extra = fields.pop("extra_body", {})
    known = {k: v for k, v in fields.items() if k in ("top_p", "temperature", "max_tokens", "presence_penalty",
                                                        "seed", "stop", "n", "logprobs", "echo", "logit_bias",
                                                        "prompt", "tools", "max_completion_tokens", "top_logprobs",
                                                        "messages", "response_format")}
    extra.update({k: v for k, v in fields.items() if k not in known})
    with pytest.raises(openai.BadRequestError) as e:
        if endpoint == "completions":
            client.completions.create(**{"model": "tiny", "prompt": "the", **known}, extra_body=extra)
        else:
            client.chat.completions.create(**{"model": "tiny", "messages": [{"role": "user", "content": "hi"}],
                                              **known}, extra_body=extra)
    error = e.value.response.json()["error"]
    assert error["type"] == "invalid_request_error"
    assert error["param"] == param, error
    assert param.split("[")[0].split(".")[0] in error["message"] or "prompt" in error["message"], error
    got = client.completions.create(model="tiny", prompt="the", max_tokens=2)  # still serving
    assert got.usage.completion_tokens >= 1


def test_unknown_fields_are_ignored_with_one_warning_and_known_ones_still_checked(servers, caplog):
    """vLLM's behaviour: a field the server does not know is dropped with one logged warning per request naming it
    (clients send their own extensions); a known field at an unsupported value still gets a 400 (the BAD cases)."""
    client = servers["plain"].client()
    with caplog.at_level("WARNING", logger="specdec.serve.protocol"):
        got = client.completions.create(model="tiny", prompt="the", max_tokens=3, temperature=0,
                                        extra_body={"frobnicate": 1, "vendor_option": {"x": 2}})
    plain = client.completions.create(model="tiny", prompt="the", max_tokens=3, temperature=0)
    assert got.choices[0].text == plain.choices[0].text  # the ignored fields changed nothing
    warnings = [r.getMessage() for r in caplog.records if "ignored" in r.getMessage()]
    assert len(warnings) == 1 and "frobnicate" in warnings[0] and "vendor_option" in warnings[0], warnings


def test_wrong_model_is_404_and_stream_errors_are_400(servers):
    client = servers["plain"].client()
    with pytest.raises(openai.NotFoundError) as e:
        client.completions.create(model="other", prompt="x", max_tokens=2)
    assert e.value.response.json()["error"]["param"] == "model"
    with pytest.raises(openai.BadRequestError):  # refused before the stream starts
        client.completions.create(model="tiny", prompt="x", top_p=5, stream=True)
    status, _, error = Http(servers["plain"]).post("/v1/completions", b"{not json")
    assert status == 400 and "JSON" in error["error"]["message"]


def test_n_samples_and_logprobs(servers, tiny_pair_plain, references):
    """n > 1 returns n choices (equal to ``LLM.generate`` with n, streamed or not); logprobs equal the library's."""
    client = servers["draft"].client()
    full = client.completions.create(model="tiny", prompt="the cat", max_tokens=12, temperature=1.0, seed=5, n=3)
    assert [c.index for c in full.choices] == [0, 1, 2]
    ref = references["draft"].generate("the cat", specdec.SamplingParams(temperature=1.0, seed=5, n=3,
                                                                        max_tokens=12))[0]
    assert [c.text for c in full.choices] == [o.text for o in ref.outputs]
    assert full.usage.completion_tokens == sum(len(o.token_ids) for o in ref.outputs)
    streamed = {i: "" for i in range(3)}
    for chunk in client.completions.create(model="tiny", prompt="the cat", max_tokens=12, temperature=1.0, seed=5,
                                           n=3, stream=True):
        for c in chunk.choices:
            streamed[c.index] += c.text
    assert [streamed[i] for i in range(3)] == [c.text for c in full.choices]

    got = client.completions.create(model="tiny", prompt="the cat", max_tokens=10, temperature=0, logprobs=2)
    ref = tiny_pair_plain.generate("the cat", specdec.SamplingParams(temperature=0, max_tokens=10, logprobs=2))[0]
    lp = got.choices[0].logprobs
    want = [entry[t] for t, entry in zip(ref.outputs[0].token_ids, ref.outputs[0].logprobs)]
    assert lp.token_logprobs == pytest.approx(want, abs=1e-5)
    assert all(1 <= len(top) <= 2 for top in lp.top_logprobs)  # keyed by token text: byte tokens may collide
    assert all(max(top.values()) >= v - 1e-6 for top, v in zip(lp.top_logprobs, lp.token_logprobs))
    chat = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=6,
                                          temperature=0, logprobs=True, top_logprobs=3)
    content = chat.choices[0].logprobs.content
    assert len(content) == chat.usage.completion_tokens
    assert all(len(t.top_logprobs) == 3 and t.logprob <= 0 for t in content)


def test_prompt_list_gives_one_choice_per_prompt_and_sample(servers, tiny_pair_plain):
    """A list of prompts (text and token ids) with n = 2: choice i * n + j is sample j of prompt i, streamed or not."""
    client = servers["plain"].client()
    ids = tiny_pair_plain.tokenizer.encode("an ant")
    args = dict(model="tiny", prompt=["the cat", ids], n=2, max_tokens=6, temperature=0)
    full = client.completions.create(**args)
    refs = tiny_pair_plain.generate(prompt_token_ids=[tiny_pair_plain.tokenizer.encode("the cat"), ids],
                                    sampling_params=specdec.SamplingParams(temperature=0, max_tokens=6))
    assert [c.index for c in full.choices] == [0, 1, 2, 3]
    assert [c.text for c in full.choices] == [refs[0].outputs[0].text] * 2 + [refs[1].outputs[0].text] * 2
    assert full.usage.prompt_tokens == len(refs[0].prompt_token_ids) + len(ids)
    streamed = {i: "" for i in range(4)}
    for chunk in client.completions.create(stream=True, **args):
        for c in chunk.choices:
            streamed[c.index] += c.text
    assert [streamed[i] for i in range(4)] == [c.text for c in full.choices]


def test_prefix_cache_hits_show_in_usage_and_metrics(servers):
    """The second request with a shared prefix reports its cached prompt tokens (OpenAI's
    usage.prompt_tokens_details.cached_tokens) and the server counts them."""
    server = servers["plain"]
    client = server.client()
    hits = lambda: _sample(Http(server).get("/metrics")[1], "specdec_prefix_cache_hits_total")  # noqa: E731
    before = hits()
    prompt = "a shared prefix of the prompt, long enough for several blocks: "
    first = client.completions.create(model="tiny", prompt=prompt + "one", max_tokens=2, temperature=0)
    second = client.completions.create(model="tiny", prompt=prompt + "two", max_tokens=2, temperature=0)
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    cached = second.usage.prompt_tokens_details.cached_tokens
    assert 0 < cached <= len(prompt) and cached % 4 == 0  # whole blocks of 4 (byte-level tokens)
    server.wait_idle()
    assert hits() - before == cached


def test_engine_failure_ends_request_with_error(servers):
    """A request that fails inside the engine gets a 500 (non-streamed) or an error event (streamed); the
    server serves on and frees its blocks."""
    server = servers["plain"]
    engine = server.llm.engine
    forward = engine.runner.forward

    def faulty(items, input_ids=None):
        for it in items:
            seq = next((s for s in engine.scheduler.running if s.seq_id == it.seq_id), None)
            if seq is not None and seq.prompt == "poison":
                raise RuntimeError("injected fault")
        return forward(items, input_ids=input_ids)

    server.async_engine.call_sync(lambda e: setattr(e.runner, "forward", faulty))
    try:
        client = server.client()
        with pytest.raises(openai.InternalServerError) as e:
            client.completions.create(model="tiny", prompt="poison", max_tokens=5)
        assert "injected fault" in e.value.response.json()["error"]["message"]
        with pytest.raises(openai.APIError, match="injected fault"):
            for _ in client.completions.create(model="tiny", prompt="poison", max_tokens=5, stream=True):
                pass
        got = client.completions.create(model="tiny", prompt="the", max_tokens=4, temperature=0)
        assert got.choices[0].finish_reason in ("length", "stop")
    finally:
        server.async_engine.call_sync(lambda e: e.runner.__dict__.pop("forward", None))
    state = server.wait_idle()
    assert state["free"] == state["total"]


def test_models_health_and_metrics(servers):
    server = servers["draft"]
    client = server.client()
    assert [m.id for m in client.models.list().data] == ["tiny"]
    assert json.loads(Http(server).get("/health")[1]) == {"status": "ok"}
    client.completions.create(model="tiny", prompt="the cat sat on the mat", max_tokens=20, temperature=0)
    status, text = Http(server).get("/metrics")
    assert status == 200
    families = {f.name: f for f in text_string_to_metric_families(text)}
    for name in ("specdec_num_requests_running", "specdec_num_requests_waiting", "specdec_prompt_tokens",
                 "specdec_generation_tokens", "specdec_kv_cache_blocks_used", "specdec_spec_decode_acceptance_rate",
                 "specdec_spec_decode_mean_tokens_per_round", "specdec_spec_decode_per_position_acceptance"):
        assert name in families, name
    assert _sample(text, "specdec_generation_tokens_total") >= 20
    # the latency histograms: TTFT once per request that generated, e2e once per finished request, the
    # inter-token latency once per generated token after each request's first
    generated, first = (_sample(text, "specdec_generation_tokens_total"),
                        _sample(text, "specdec_time_to_first_token_seconds_count"))
    assert first >= 1 and _sample(text, "specdec_e2e_request_latency_seconds_count") >= 1
    assert _sample(text, "specdec_inter_token_latency_seconds_count") == generated - first
    assert 0 < _sample(text, "specdec_spec_decode_acceptance_rate") <= 1
    assert _sample(text, "specdec_spec_decode_mean_tokens_per_round") >= 1
    positions = [s for s in families["specdec_spec_decode_per_position_acceptance"].samples]
    assert {s.labels["position"] for s in positions} >= {"0"}
    total = _sample(text, "specdec_kv_cache_blocks_total")
    assert total == ENGINE["num_kv_blocks"]
    assert _sample(text, "specdec_kv_cache_usage_ratio") == _sample(text, "specdec_kv_cache_blocks_used") / total
    # once idle, the gauge shows every block back in the pool (the loop publishes after each iteration)
    assert not server.wait_idle()["unfinished"]
    deadline = time.monotonic() + 5.0
    while (used := _sample(Http(server).get("/metrics")[1], "specdec_kv_cache_blocks_used")) and (
            time.monotonic() < deadline):
        time.sleep(0.02)
    assert used == 0, "blocks still used once the server is idle"


def test_graceful_shutdown_ends_in_flight_streams(tiny_pair):
    """Shutdown with a request still running: the stream ends (finished or with an abort error event) within the
    grace time, and the engine thread stops."""
    server = ServerThread(tiny_pair[0], shutdown_timeout=0.5, **ENGINE).start()
    body = {"model": "tiny", "prompt": "the", "max_tokens": 250, "temperature": 0.5, "stream": True,
            "ignore_eos": True}
    events = []
    start = time.monotonic()
    conn, response = Http(server).stream("/v1/completions", body)
    try:
        for event in Http.events(response):
            events.append(event)
            if len(events) == 2:
                server.server.should_exit = True
    finally:
        conn.close()
    server.thread.join(30)
    assert not server.thread.is_alive() and not server.async_engine.is_alive
    assert time.monotonic() - start < 30
    last = json.loads(events[-2]) if events[-1] == "[DONE]" else None
    assert last is None or "error" in last or last["choices"][0]["finish_reason"] == "length"


def _sample(text: str, name: str, labels: dict | None = None, default: float | None = None) -> float:
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == name and all(s.labels.get(k) == v for k, v in (labels or {}).items()):
                return s.value
    if default is not None:
        return default
    raise AssertionError(f"{name} {labels} not in /metrics")


def test_api_key_guards_every_route_but_health_and_cors_answers_allowed_origins(tiny_pair):
    """``build_app(api_key=)``: 401 in OpenAI's shape without the right bearer token, on the API and on /metrics;
    /health stays open for probes. ``allowed_origins``: CORS headers for an allowed origin only."""
    import http.client

    server = ServerThread(tiny_pair[0], app_kwargs={"api_key": "s3cret", "allowed_origins": ["http://ok.example"]},
                          **ENGINE).start()
    try:
        def request(method, path, headers=None, body=None):
            conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=30)
            try:
                conn.request(method, path, body, {"Content-Type": "application/json", **(headers or {})})
                r = conn.getresponse()
                return r.status, {k.lower(): v for k, v in r.getheaders()}, r.read()
            finally:
                conn.close()

        body = json.dumps({"model": "tiny", "prompt": "the", "max_tokens": 2})
        for path, method in (("/v1/models", "GET"), ("/metrics", "GET"), ("/v1/completions", "POST")):
            for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "s3cret"}):
                status, _, raw = request(method, path, headers, body if method == "POST" else None)
                assert status == 401, (path, headers, status)
                assert json.loads(raw)["error"]["code"] == "invalid_api_key"
        assert request("GET", "/health")[0] == 200
        ok = {"Authorization": "Bearer s3cret"}
        assert request("GET", "/v1/models", ok)[0] == 200
        status, _, raw = request("POST", "/v1/completions", ok, body)
        assert status == 200 and json.loads(raw)["usage"]["completion_tokens"] >= 1
        assert server.client(api_key="s3cret").completions.create(model="tiny", prompt="the", max_tokens=2).choices
        preflight = {"Origin": "http://ok.example", "Access-Control-Request-Method": "POST"}
        status, headers, _ = request("OPTIONS", "/v1/completions", preflight)
        assert status == 200 and headers.get("access-control-allow-origin") == "http://ok.example"
        _, headers, _ = request("GET", "/v1/models", {**ok, "Origin": "http://evil.example"})
        assert "access-control-allow-origin" not in headers
    finally:
        server.stop()


def test_request_timeout_aborts_frees_blocks_and_metrics_on_request(tiny_pair):
    """``build_app(request_timeout=)``: a request still running past it is aborted and answered 504 (a stream ends
    with an error event), its blocks freed; ``return_metrics: true`` adds each request's metrics to the response."""
    server = ServerThread(tiny_pair[0], app_kwargs={"request_timeout": 0.3},
                          speculative=specdec.SpeculativeConfig(method="ngram_table", num_speculative_tokens=3),
                          **ENGINE).start()
    try:
        client = server.client()
        long = {"model": "tiny", "prompt": "the", "max_tokens": 200, "temperature": 0,
                "extra_body": {"ignore_eos": True}}
        step = server.llm.engine.step

        def slow_step(*args, **kwargs):
            time.sleep(0.02)  # 200 tokens take > 4 s: far past the 0.3 s timeout
            return step(*args, **kwargs)

        server.llm.engine.step = slow_step
        with pytest.raises(openai.APIStatusError) as e:
            client.completions.create(**long)
        assert e.value.status_code == 504 and e.value.response.json()["error"]["code"] == "request_timeout"
        with pytest.raises(openai.APIError) as e:
            for _ in client.completions.create(**long, stream=True):
                pass
        assert "request timeout" in str(e.value), e.value
        server.llm.engine.step = step
        state = server.wait_idle()
        assert not state["unfinished"] and state["free"] == state["total"], state
        got = client.completions.create(model="tiny", prompt="the cat the cat the cat", max_tokens=8, temperature=0,
                                        extra_body={"return_metrics": True})
        metrics = got.model_extra["metrics"]
        assert len(metrics) == 1 and {"drafted", "accepted", "acceptance_rate"} <= set(metrics[0])
    finally:
        server.stop()


def test_openapi_describes_exactly_the_fields_the_server_accepts(servers):
    """/docs serves FastAPI's page and /openapi.json gives both generation routes their request and response
    bodies; the documented request fields are exactly those protocol.py accepts (so the docs cannot drift)."""
    from specdec.serve.openapi_models import ChatCompletionRequest, CompletionRequest
    from specdec.serve.protocol import CHAT_FIELDS, COMPLETION_FIELDS, NEUTRAL

    http = Http(servers["plain"])
    status, page = http.get("/docs")
    assert status == 200 and "swagger" in page.lower()
    status, raw = http.get("/openapi.json")
    schema = json.loads(raw)
    chat = schema["paths"]["/v1/chat/completions"]["post"]
    assert chat["requestBody"]["content"]["application/json"]["schema"]["$ref"].endswith("/ChatCompletionRequest")
    assert "tools" in schema["components"]["schemas"]["ChatCompletionRequest"]["properties"]
    assert schema["components"]["schemas"]["ChatCompletionResponse"]["properties"]["choices"]
    assert set(CompletionRequest.model_fields) == COMPLETION_FIELDS | set(NEUTRAL)
    assert set(ChatCompletionRequest.model_fields) == CHAT_FIELDS | set(NEUTRAL)


def test_each_api_key_is_its_own_tenant(tiny_pair):
    """``build_app(api_key=[k1, k2])``: either key is accepted, and the engine gets the key's tenant (its index,
    never the key) - what scopes the suffix drafter's index; no key: the anonymous tenant (None)."""
    tenants = []
    for keys in (["k1", "k2"], None):
        server = ServerThread(tiny_pair[0], app_kwargs={"api_key": keys}, **ENGINE)
        real = server.llm.engine.add_request

        def add_request(*args, tenant=None, real=real, **kwargs):
            tenants.append(tenant)
            return real(*args, tenant=tenant, **kwargs)

        server.llm.engine.add_request = add_request
        server.start()
        try:
            for key in (["k2", "k1"] if keys else ["none"]):
                client = server.client(api_key=key)
                assert client.completions.create(model="tiny", prompt="the", max_tokens=2).choices
        finally:
            server.stop()
    assert tenants == ["api-key-1", "api-key-0", None]
    with pytest.raises(ValueError, match="must not be empty"):
        build_app(small_llm(tiny_pair[0], **ENGINE).engine, "tiny", api_key=["k1", ""])
