"""The OpenAI-compatible HTTP API (FastAPI): completions and chat (SSE streaming or not), models, health, metrics.

Each HTTP request becomes one engine request per prompt (``n`` samples each) on the ``AsyncEngine``; choice
``i * n + j`` is sample j of prompt i. Errors use OpenAI's shape (``protocol.RequestError``): 400 for a bad or
unsupported field (named in ``param``), 404 for another model name, 503 with ``Retry-After`` when the waiting
queue is full or the server is shutting down, 500 when the request failed inside the engine (``finish_reason
"error"``). A streamed request that fails after its first chunk ends with an ``{"error": ...}`` event, then
``[DONE]``. A client that disconnects aborts its requests at once (their KV blocks are freed). With an API key every
route but ``/health`` answers 401 without ``Authorization: Bearer KEY``; ``allowed_origins`` turns CORS on.

Over 300 lines: one route per OpenAI endpoint and their streaming / non-streaming bodies, which read best side by
side; request parsing is in ``protocol.py``, the engine thread in ``async_engine.py``.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse, Response, StreamingResponse

from specdec.engine.engine import LLMEngine
from specdec.outputs import CompletionOutput, RequestOutput
from specdec.serve.async_engine import AsyncEngine, QueueFullError, RequestStream, ShuttingDownError
from specdec.serve.metrics import ServerMetrics
from specdec.serve.openapi_models import document
from specdec.serve.protocol import ParsedRequest, RequestError, constraint_message, parse_chat, parse_completion
from specdec.tool_calls import call_constraint, parse_calls, render_messages, tool_format

RETRY_AFTER_S = 1  # what a 503 tells the client to wait


def build_app(engine: LLMEngine, model_name: str, max_waiting: int = 64, shutdown_timeout: float = 10.0,
              api_key: str | list[str] | None = None, allowed_origins: list[str] | None = None,
              request_timeout: float | None = None, chat_template: str | None = None) -> FastAPI:
    """The ASGI app serving ``engine`` as ``model_name``. The engine loop starts and stops with the app's
    lifespan (uvicorn runs it); ``app.state.async_engine`` is the ``AsyncEngine``. ``api_key``: every route but
    ``/health`` needs ``Authorization: Bearer <api_key>`` (else 401, OpenAI's error shape); a list of keys: any of
    them, each key its own tenant (``LLMEngine.add_request(tenant=)``: the suffix drafter's index is per tenant;
    without a key every request is the anonymous tenant); ``allowed_origins``:
    browser origins allowed by CORS (``["*"]``: any; None: no CORS headers); ``request_timeout``: seconds a request
    may take from arrival to its last token (None: no limit) - past it the request is aborted (its blocks freed)
    and answered 504, or a stream ends with an error event; ``chat_template``: the template chat requests are
    rendered with instead of the model's (its text, or the name of one of the model's named templates)."""
    if request_timeout is not None and not request_timeout > 0:
        raise ValueError(f"request_timeout must be a number of seconds > 0, got {request_timeout!r}")
    if chat_template is not None and "{" not in chat_template:  # a name: one of the model's named templates
        named = sorted(engine.tokenizer.chat_templates) if engine.tokenizer is not None else []
        if chat_template not in named:
            raise ValueError(f"chat template {chat_template!r} is neither a Jinja template nor one of the model's "
                             f"named templates {named}")
    metrics = ServerMetrics(model_name)
    async_engine = AsyncEngine(engine, max_waiting=max_waiting, metrics=metrics)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        async_engine.start()
        yield
        await async_engine.shutdown(shutdown_timeout)

    app = FastAPI(title="specdec", lifespan=lifespan)
    document(app)  # the request and response bodies in /docs and /openapi.json
    if api_key is not None:
        keys = [api_key] if isinstance(api_key, str) else list(api_key)
        if not keys or not all(isinstance(k, str) and k for k in keys):
            raise ValueError("the API key must not be empty (and a list of keys must hold non-empty strings)")
        expected = [f"Bearer {k}".encode() for k in keys]

        @app.middleware("http")
        async def require_api_key(request: Request, call_next):
            if request.url.path == "/health" or request.method == "OPTIONS":  # probes; CORS preflights
                return await call_next(request)
            given = request.headers.get("authorization", "").encode()
            # every key compared (constant time each), so the time taken does not say which key matched
            matched = [i for i, e in enumerate(expected) if hmac.compare_digest(given, e)]
            if not matched:
                error = RequestError("a valid API key is required: send 'Authorization: Bearer <key>'",
                                     status=401, type="authentication_error", code="invalid_api_key")
                return JSONResponse(error.body(), status_code=401)
            request.state.tenant = f"api-key-{matched[0]}"  # the key's index, never the key itself
            return await call_next(request)
    if allowed_origins:
        app.add_middleware(CORSMiddleware, allow_origins=list(allowed_origins), allow_methods=["*"],
                           allow_headers=["*"], allow_credentials=False)
    app.state.async_engine = async_engine
    app.state.metrics = metrics
    created = int(time.time())
    server = _Server(async_engine, metrics, model_name, request_timeout, chat_template)

    @app.get("/health")
    async def health() -> Response:
        error = engine.health_error  # a tensor-parallel worker died or hung (docs/tensor_parallel.md)
        if async_engine.is_alive and error is None:
            return JSONResponse({"status": "ok"})
        return JSONResponse({"status": "error", "error": async_engine.loop_error or error}, status_code=503)

    @app.get("/v1/models")
    async def models() -> Response:
        return JSONResponse({"object": "list", "data": [{
            "id": model_name, "object": "model", "created": created, "owned_by": "specdec",
            "max_model_len": engine.config.max_model_len}]})

    @app.get("/metrics")
    async def prometheus() -> Response:
        return Response(metrics.render(), media_type=metrics.content_type)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await server.handle(request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await server.handle(request, chat=True)

    return app


class _Server:
    def __init__(self, async_engine: AsyncEngine, metrics: ServerMetrics, model_name: str,
                 request_timeout: float | None = None, chat_template: str | None = None):
        self.engine = async_engine
        self.metrics = metrics
        self.model_name = model_name
        self.request_timeout = request_timeout
        self.tokenizer = async_engine.engine.tokenizer
        self.sampling_defaults = async_engine.engine.config.sampling_defaults  # the model's (generation_config.json)
        self.chat_template = chat_template  # None: the model's default

    async def handle(self, request: Request, chat: bool) -> Response:
        try:
            try:
                body = json.loads(await request.body())
            except (json.JSONDecodeError, UnicodeDecodeError) as e:
                raise RequestError(f"the request body is not valid JSON: {e}") from None
            req = (parse_chat(body, self.model_name, self.sampling_defaults) if chat
                   else parse_completion(body, self.model_name, self.sampling_defaults))
            if chat:
                req.prompts = [self._render(req)]
            streams = await self._add_all(req, getattr(request.state, "tenant", None))
        except RequestError as e:
            return self._error(e)
        created = int(time.time())
        rid = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        if req.stream:
            return StreamingResponse(self._sse(streams, req, rid, created), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        return await self._complete(request, streams, req, rid, created)

    def _render(self, req: ParsedRequest) -> str:
        """The chat template applied to the request's messages, with its tools in the model's call format
        (``specdec/tool_calls.py``); a "required" or named ``tool_choice`` also sets the answer's grammar. A pure
        function of the read-only tokenizer, so it runs here, off the engine thread."""
        if self.tokenizer is None:
            raise RequestError("this model has no tokenizer, so chat requests cannot be rendered", "messages")
        fmt = tool_format(self._template())
        tools = req.tools if req.tool_choice != "none" else []
        tags = (self.tokenizer.token_to_id("<tool_call>"), self.tokenizer.token_to_id("</tool_call>"))
        tag_ids = tags if None not in tags else None
        constraint = call_constraint(tools, req.tool_choice, fmt, tag_ids) if tools else None
        if constraint is not None:
            req.params.structured_outputs = constraint
            req.structured_field = "tool_choice"
        try:
            messages = render_messages(req.messages, tools, fmt)
            return self.tokenizer.apply_chat_template(messages, add_generation_prompt=True,
                                                      tools=tools if fmt != "generic" else None,
                                                      chat_template=self.chat_template,
                                                      chat_template_kwargs=req.chat_template_kwargs)
        except ValueError as e:
            raise RequestError(str(e), "messages") from None

    def _template(self) -> str | None:
        """The chat template in use: ``--chat-template`` (a name of the model's or a text), else the model's."""
        if self.chat_template is None:
            return self.tokenizer.chat_template
        return self.tokenizer.chat_templates.get(self.chat_template, self.chat_template)

    def _answer(self, req: ParsedRequest, text: str, finish_reason: str | None) -> tuple[dict, str | None]:
        """A chat choice's message (with ``tool_calls`` parsed from the text when tools are on) and its finish
        reason ("tool_calls" when the answer is a call)."""
        if not req.tools or req.tool_choice == "none":
            return {"role": "assistant", "content": text}, finish_reason
        content, calls = parse_calls(text, tool_format(self._template()), req.tools)
        if not calls:
            return {"role": "assistant", "content": text}, finish_reason
        return ({"role": "assistant", "content": content, "tool_calls": calls},
                "tool_calls" if finish_reason == "stop" else finish_reason)

    async def _add_all(self, req: ParsedRequest, tenant: str | None) -> list[RequestStream]:
        streams: list[RequestStream] = []
        try:
            for prompt in req.prompts:
                text, ids = (prompt, None) if isinstance(prompt, str) else (None, prompt)
                streams.append(await self.engine.add(text, req.params, ids, fill_max_tokens=req.fill_max_tokens,
                                                     tenant=tenant))
        except BaseException as e:
            for s in streams:
                self.engine.abort(s.request_id)
            if isinstance(e, ValueError):
                message = str(e)
                if message.startswith("structured_outputs") and req.structured_field is not None:
                    raise RequestError(constraint_message(message, req.structured_field),
                                       req.structured_field) from None
                raise RequestError(_engine_message(message), _engine_param(message, req.chat)) from None
            if isinstance(e, QueueFullError):
                raise RequestError(str(e), None, status=503, type="server_overloaded", code="queue_full") from None
            if isinstance(e, ShuttingDownError):
                raise RequestError(str(e), None, status=503, type="server_unavailable") from None
            raise
        return streams

    def _error(self, e: RequestError) -> Response:
        self.metrics.rejected.labels(status=str(e.status)).inc()
        headers = {"Retry-After": str(RETRY_AFTER_S)} if e.status == 503 else None
        return JSONResponse(e.body(), status_code=e.status, headers=headers)

    # --- non-streaming ----------------------------------------------------------------------------------------
    async def _complete(self, request: Request, streams: list[RequestStream], req: ParsedRequest, rid: str,
                        created: int) -> Response:
        collect = asyncio.ensure_future(asyncio.gather(*(_last(s) for s in streams)))
        gone = asyncio.ensure_future(_wait_disconnect(request))
        try:
            await asyncio.wait({collect, gone}, timeout=self.request_timeout, return_when=asyncio.FIRST_COMPLETED)
        finally:
            gone.cancel()
            if not collect.done():  # the client left (or this task was cancelled): abort, free the blocks
                collect.cancel()
                for s in streams:
                    self.engine.abort(s.request_id)
        if not collect.done() or collect.cancelled():
            if not gone.done():  # neither finished nor left: the request ran out of time
                return self._error(_timed_out(self.request_timeout))
            return Response(status_code=499)
        finals: list[RequestOutput] = collect.result()
        failed = _failure(finals)
        if failed is not None:
            return self._error(failed)
        choices = []
        for i, out in enumerate(finals):
            for c in out.outputs:
                choice = {"index": i * req.n + c.index, "finish_reason": c.finish_reason}
                logprobs = self._logprobs(c, 0, len(c.token_ids), req, 0) if req.logprobs is not None else None
                if req.chat:
                    choice["message"], choice["finish_reason"] = self._answer(req, c.text, c.finish_reason)
                else:
                    choice["text"] = c.text
                choice["logprobs"] = logprobs
                choices.append(choice)
        choices.sort(key=lambda c: c["index"])
        body = {"id": rid, "object": "chat.completion" if req.chat else "text_completion", "created": created,
                "model": self.model_name, "choices": choices, "usage": _usage(finals)}
        if req.return_metrics:  # one entry per prompt: drafted, accepted, acceptance rate, tau, TTFT... (metrics.md)
            body["metrics"] = [out.metrics for out in finals]
        return JSONResponse(body)

    # --- streaming --------------------------------------------------------------------------------------------
    async def _sse(self, streams: list[RequestStream], req: ParsedRequest, rid: str, created: int
                   ) -> AsyncIterator[str]:
        """Server-sent events: one chunk per choice whenever its safe-to-show text or tokens advance."""
        kind = "chat.completion.chunk" if req.chat else "text_completion"
        head = {"id": rid, "object": kind, "created": created, "model": self.model_name}
        shown_text: dict[int, int] = {}
        shown_tokens: dict[int, int] = {}
        finals: dict[int, RequestOutput] = {}
        tools_on = req.chat and bool(req.tools) and req.tool_choice != "none"
        try:
            if req.chat:  # the role comes first, once per choice (as OpenAI does)
                for i in range(len(streams) * req.n):
                    yield _event({**head, "choices": [{"index": i, "delta": {"role": "assistant", "content": ""},
                                                       "logprobs": None, "finish_reason": None}]})
            deadline = None if self.request_timeout is None else time.monotonic() + self.request_timeout
            async for i, out in _merge(streams, deadline):
                if out is None:  # the deadline passed: the finally below aborts what is still running
                    yield _event(_timed_out(self.request_timeout).body())
                    yield "data: [DONE]\n\n"
                    return
                if out.finished:
                    finals[i] = out
                failed = _failure([out])  # any sample failed (n > 1: the others are aborted below)
                if failed is not None:
                    yield _event(failed.body())
                    yield "data: [DONE]\n\n"
                    return
                for c in out.outputs:
                    index = i * req.n + c.index
                    if tools_on:  # a call is parsed from the whole answer: one chunk at the end
                        if c.finish_reason is not None:
                            yield _event({**head, "choices": [self._tool_chunk(req, index, c)]})
                        continue
                    text = c.text[shown_text.get(index, 0):]
                    start, end = shown_tokens.get(index, 0), len(c.token_ids)
                    if not text and start == end and c.finish_reason is None:
                        continue
                    shown_text[index] = len(c.text)
                    shown_tokens[index] = end
                    logprobs = (self._logprobs(c, start, end, req, shown_text[index] - len(text))
                                if req.logprobs is not None else None)
                    if req.chat:
                        delta = {"content": text} if text or c.finish_reason is None else {}
                        choice = {"index": index, "delta": delta}
                    else:
                        choice = {"index": index, "text": text}
                    choice.update(logprobs=logprobs, finish_reason=c.finish_reason)
                    yield _event({**head, "choices": [choice]})
            if req.include_usage:
                last = {**head, "choices": [], "usage": _usage([finals[i] for i in sorted(finals)])}
                if req.return_metrics:
                    last["metrics"] = [finals[i].metrics for i in sorted(finals)]
                yield _event(last)
            yield "data: [DONE]\n\n"
        finally:
            for s in streams:  # no-op for finished ones; a client that left aborts the rest at once
                if not s.finished:
                    self.engine.abort(s.request_id)

    def _tool_chunk(self, req: ParsedRequest, index: int, c: CompletionOutput) -> dict:
        """The one delta of a tool-enabled chat choice: its text and its calls (``index`` per call, as the OpenAI
        client accumulates them), with the finish reason."""
        message, finish = self._answer(req, c.text, c.finish_reason)
        delta = {}
        if message.get("content"):
            delta["content"] = message["content"]
        if message.get("tool_calls"):
            delta["tool_calls"] = [{"index": j, **call} for j, call in enumerate(message["tool_calls"])]
        logprobs = self._logprobs(c, 0, len(c.token_ids), req, 0) if req.logprobs is not None else None
        return {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish}

    # --- logprobs ---------------------------------------------------------------------------------------------
    def _logprobs(self, c: CompletionOutput, start: int, end: int, req: ParsedRequest, text_offset: int):
        """OpenAI's logprobs object for tokens ``[start, end)`` of ``c`` (chat: ``{"content": [...]}``;
        completions: parallel lists with ``text_offset`` counted from ``text_offset``)."""
        entries = (c.logprobs or [])[start:end]
        ids = c.token_ids[start:end]
        top_n = req.logprobs or 0
        if req.chat:
            content = []
            for token, entry in zip(ids, entries):
                top = list(entry.items())[:top_n]
                content.append({**self._token(token, entry[token]),
                                "top_logprobs": [self._token(t, lp) for t, lp in top]})
            return {"content": content}
        tokens, values, tops, offsets = [], [], [], []
        offset = text_offset
        for token, entry in zip(ids, entries):
            text = self._decode(token)
            tokens.append(text)
            values.append(entry[token])
            tops.append(self._top_by_text(entry, top_n) if top_n else None)
            offsets.append(offset)
            offset += len(text)
        return {"tokens": tokens, "token_logprobs": values, "top_logprobs": tops, "text_offset": offsets}

    def _top_by_text(self, entry: dict[int, float], top_n: int) -> dict[str, float]:
        """OpenAI's completions ``top_logprobs`` are keyed by token text; where two tokens decode alike (byte
        tokens of a partial character), the likelier one keeps the key."""
        top: dict[str, float] = {}
        for token, logprob in list(entry.items())[:top_n]:  # descending order
            top.setdefault(self._decode(token), logprob)
        return top

    def _token(self, token: int, logprob: float) -> dict:
        text = self._decode(token)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}

    def _decode(self, token: int) -> str:
        return self.tokenizer.decode([token], skip_special_tokens=False) if self.tokenizer else f"<{token}>"


async def _last(stream: RequestStream) -> RequestOutput:
    last = None
    async for out in stream:
        last = out
    return last


async def _merge(streams: list[RequestStream], deadline: float | None = None
                 ) -> AsyncIterator[tuple[int, RequestOutput | None]]:
    """(prompt index, output) from every stream as they come, then ``(-1, None)`` once if ``deadline``
    (``time.monotonic()``) passes first; cancelling the consumer cancels the readers (whose streams then abort their
    requests)."""
    if len(streams) == 1 and deadline is None:  # the common case: no reader task, no queue
        async for out in streams[0]:
            yield 0, out
        return
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(i: int, stream: RequestStream) -> None:
        async for out in stream:
            await queue.put((i, out))
        await queue.put((i, None))

    tasks = [asyncio.ensure_future(pump(i, s)) for i, s in enumerate(streams)]
    try:
        left = len(streams)
        while left:
            try:
                wait = None if deadline is None else max(0.0, deadline - time.monotonic())
                i, out = await asyncio.wait_for(queue.get(), wait)
            except asyncio.TimeoutError:
                yield -1, None
                return
            if out is None:
                left -= 1
            else:
                yield i, out
    finally:
        for t in tasks:
            t.cancel()


def _timed_out(seconds: float | None) -> RequestError:
    return RequestError(f"the request did not finish within the server's request timeout ({seconds:g} s); it was "
                        "aborted", None, status=504, type="timeout", code="request_timeout")


async def _wait_disconnect(request: Request) -> None:
    """Return when the client disconnects (the body is already read, so ``receive`` waits for that)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


def _failure(finals: list[RequestOutput]) -> RequestError | None:
    """The error response for a request any of whose samples failed in the engine or was aborted (shutdown),
    else None. OpenAI's shape has no per-choice error, so one failed sample fails the HTTP request."""
    for out in finals:
        reasons = {c.finish_reason for c in out.outputs} if out.outputs else {"error"}
        if "error" in reasons:
            return RequestError(f"the request failed in the engine: {out.error}", None, status=500,
                                type="server_error", code="engine_error")
        if "abort" in reasons:
            return RequestError("the request was aborted (the server is shutting down)", None, status=503,
                                type="server_unavailable", code="aborted")
    return None


def _usage(finals: list[RequestOutput]) -> dict:
    prompt = sum(len(out.prompt_token_ids) for out in finals)
    completion = sum(len(c.token_ids) for out in finals for c in out.outputs)
    cached = sum((out.metrics or {}).get("num_cached_tokens") or 0 for out in finals)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": cached}}


def _event(payload: dict) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"


def _engine_param(message: str, chat: bool) -> str | None:
    """The request field an ``LLMEngine.add_request`` ``ValueError`` is about."""
    if message.startswith("SamplingParams."):
        return message[len("SamplingParams."):].split("=", 1)[0]
    return "messages" if chat else "prompt"


def _engine_message(message: str) -> str:
    return message[len("SamplingParams."):] if message.startswith("SamplingParams.") else message
