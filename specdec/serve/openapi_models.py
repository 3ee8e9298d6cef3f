"""Pydantic models of the server's request and response bodies, for the OpenAPI schema only (``/docs``,
``/openapi.json``).

Requests are parsed by ``protocol.py`` as plain JSON (so every refusal names its field in OpenAI's error shape);
these models describe the same fields - a test checks that they list exactly the fields ``protocol.py`` accepts.
"""

from __future__ import annotations

from typing import Any, Literal

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel, Field


class _Sampling(BaseModel):
    model: str = Field(description="the served model name (`--served-model-name`)")
    max_tokens: int | None = Field(None, ge=1, description="tokens to generate at most")
    temperature: float | None = Field(None, ge=0, description="0 = greedy")
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=0, description="vLLM's extension; 0 = off")
    min_p: float | None = Field(None, ge=0, le=1, description="vLLM's extension")
    presence_penalty: float | None = Field(None, ge=-2, le=2)
    frequency_penalty: float | None = Field(None, ge=-2, le=2)
    repetition_penalty: float | None = Field(None, gt=0, description="vLLM's extension; 1 = off")
    seed: int | None = Field(None, ge=0, description="the request's randomness key (docs/guarantees.md)")
    stop: str | list[str] | None = None
    ignore_eos: bool | None = Field(None, description="vLLM's extension")
    n: int | None = Field(None, ge=1, le=128, description="independent samples per prompt")
    stream: bool | None = Field(None, description="server-sent events, ending with `data: [DONE]`")
    stream_options: dict[str, bool] | None = Field(None, description='{"include_usage": true}')
    user: str | None = Field(None, description="accepted, not used")
    response_format: dict[str, Any] | None = Field(
        None, description='{"type": "text" | "json_object"} or {"type": "json_schema", "json_schema": {"name", '
                          '"schema", "strict"}}')
    structured_outputs: dict[str, Any] | None = Field(
        None, description="vLLM's: one of json, json_object, regex, choice, grammar (+ disable_any_whitespace)")
    guided_json: dict[str, Any] | str | None = Field(None, description="vLLM's older field: a JSON schema")
    guided_regex: str | None = Field(None, description="vLLM's older field: a regex")
    guided_choice: list[str] | None = Field(None, description="vLLM's older field: one of these strings")
    guided_grammar: str | None = Field(None, description="vLLM's older field: a Lark grammar")
    return_metrics: bool | None = Field(None, description="ours: each request's speculation metrics in `metrics`")
    echo: bool | None = Field(None, description="only false")
    suffix: str | None = Field(None, description="only empty")
    best_of: int | None = Field(None, description="only 1")
    logit_bias: dict[str, float] | None = Field(None, description="only empty")


class CompletionRequest(_Sampling):
    """``POST /v1/completions``."""

    prompt: str | list[int] | list[str | list[int]] = Field(description="text, token ids, or a list of either")
    logprobs: int | None = Field(None, ge=0, le=20, description="top log-probabilities per token")


class ChatMessage(BaseModel):
    role: str
    content: str | list[dict[str, Any]] | None = Field(description="text or text parts; null with tool_calls")
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = Field(None, description="an assistant's calls")
    tool_call_id: str | None = Field(None, description="a tool message's call")


class ChatCompletionRequest(_Sampling):
    """``POST /v1/chat/completions``."""

    messages: list[ChatMessage]
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool | None = None
    top_logprobs: int | None = Field(None, ge=0, le=20)
    tools: list[dict[str, Any]] | None = Field(None, description='[{"type": "function", "function": {...}}]')
    tool_choice: str | dict[str, Any] | None = Field(None, description='"none", "auto", "required" or a function')
    parallel_tool_calls: bool | None = None
    chat_template_kwargs: dict[str, Any] | None = Field(None, description="vLLM's: more variables for the template")


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: dict[str, int] = Field(description='{"cached_tokens": N}')


class CompletionChoice(BaseModel):
    index: int
    text: str
    finish_reason: Literal["stop", "length", "abort", "error"] | None
    logprobs: dict[str, Any] | None = None


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage
    metrics: list[dict[str, Any]] | None = Field(None, description="with `return_metrics`")


class AssistantMessage(BaseModel):
    role: Literal["assistant"]
    content: str | None
    tool_calls: list[dict[str, Any]] | None = None


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    finish_reason: Literal["stop", "length", "tool_calls", "abort", "error"] | None
    logprobs: dict[str, Any] | None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"]
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage
    metrics: list[dict[str, Any]] | None = Field(None, description="with `return_metrics`")


class ErrorBody(BaseModel):
    message: str
    type: str
    param: str | None
    code: str | None


class ErrorResponse(BaseModel):
    error: ErrorBody


ROUTES = {
    "/v1/completions": (CompletionRequest, CompletionResponse),
    "/v1/chat/completions": (ChatCompletionRequest, ChatCompletionResponse),
}


def document(app: FastAPI) -> None:
    """Give ``app``'s OpenAPI schema the request and response bodies of the two generation routes (their handlers
    read the raw body, so FastAPI cannot see them)."""

    def openapi() -> dict:
        if app.openapi_schema:
            return app.openapi_schema
        schema = get_openapi(title=app.title, version=app.version, routes=app.routes,
                             description="OpenAI-compatible completions and chat (docs/api.md, 'Server')")
        components = schema.setdefault("components", {}).setdefault("schemas", {})

        def ref(model: type[BaseModel]) -> dict:
            body = model.model_json_schema(ref_template="#/components/schemas/{model}")
            components.update(body.pop("$defs", {}))
            components[model.__name__] = body
            return {"$ref": f"#/components/schemas/{model.__name__}"}

        for path, (request, response) in ROUTES.items():
            operation = schema["paths"][path]["post"]
            operation["requestBody"] = {"required": True, "content": {"application/json": {"schema": ref(request)}}}
            operation["responses"] = {
                "200": {"description": "the completion (`stream: true`: server-sent chunks)",
                        "content": {"application/json": {"schema": ref(response)},
                                    "text/event-stream": {"schema": {"type": "string"}}}},
                "400": {"description": "a bad or unsupported field (`param` names it)",
                        "content": {"application/json": {"schema": ref(ErrorResponse)}}},
            }
        app.openapi_schema = schema
        return schema

    app.openapi = openapi
