"""OpenAI request bodies -> what the engine runs; OpenAI's error shape.

Bodies are parsed as plain JSON dicts, not pydantic models, so that every refusal names the exact field. A field
the server does not know is ignored with one logged warning per request naming it (as vLLM does: strict 400s for
unknown fields broke clients that send their own extensions); a field the server knows but does not implement is
accepted only at its neutral value (``echo: false``, ``logit_bias: {}``...) and refused with a 400 naming it
otherwise; sampling values are checked by ``SamplingParams`` itself and its ``ValueError`` becomes the message,
naming the request's field.
"""

from __future__ import annotations

import dataclasses
import logging
import re
from dataclasses import dataclass, field

from specdec.sampling.params import SamplingParams
from specdec.structured.params import StructuredOutputsParams
from specdec.tool_calls import check_tool_choice, check_tools

logger = logging.getLogger(__name__)

# fields of both endpoints; top_k, min_p, repetition_penalty and ignore_eos are vLLM's extensions
_COMMON = {"model", "max_tokens", "temperature", "top_p", "n", "stream", "stream_options", "stop",
           "presence_penalty", "frequency_penalty", "seed", "user",
           "top_k", "min_p", "repetition_penalty", "ignore_eos"}
# structured outputs: OpenAI's response_format, vLLM's structured_outputs and its older guided_* fields (one of them)
STRUCTURED = ("response_format", "structured_outputs", "guided_json", "guided_regex", "guided_choice",
              "guided_grammar")
_COMMON |= set(STRUCTURED) | {"return_metrics"}  # ours: each request's speculation metrics in the response
COMPLETION_FIELDS = _COMMON | {"prompt", "logprobs"}
CHAT_FIELDS = _COMMON | {"messages", "max_completion_tokens", "logprobs", "top_logprobs", "tools", "tool_choice",
                         "parallel_tool_calls", "chat_template_kwargs"}
# known but not implemented: accepted only at the value that means "off"
NEUTRAL = {
    "echo": (False, None),
    "suffix": (None, ""),
    "best_of": (None, 1),
    "logit_bias": (None, {}),
}
# SamplingParams fields set from a request field of the same name
_SAMPLING = ("temperature", "top_p", "top_k", "min_p", "presence_penalty", "frequency_penalty",
             "repetition_penalty", "seed", "stop", "ignore_eos")
MAX_TOP_LOGPROBS = 20  # OpenAI's limit


class RequestError(Exception):
    """An HTTP error in OpenAI's shape: ``{"error": {"message", "type", "param", "code"}}``."""

    def __init__(self, message: str, param: str | None = None, status: int = 400,
                 type: str = "invalid_request_error", code: str | None = None):
        super().__init__(message)
        self.message, self.param, self.status, self.type, self.code = message, param, status, type, code

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


@dataclass
class ParsedRequest:
    """A validated request: one engine request per prompt, each with ``n`` samples."""

    prompts: list[str | list[int]]  # text or token ids
    params: SamplingParams
    n: int = 1
    stream: bool = False
    include_usage: bool = False
    logprobs: int | None = None  # top logprobs per token; None = no logprobs
    fill_max_tokens: bool = False  # chat without max_tokens: what the context has left
    chat: bool = False
    messages: list[dict] = field(default_factory=list)
    structured_field: str | None = None  # the request field the output constraint came from
    return_metrics: bool = False  # add each prompt's request metrics (RequestOutput.metrics) to the response
    tools: list[dict] = field(default_factory=list)  # chat: OpenAI's tools (specdec/tool_calls.py)
    tool_choice: str | dict = "none"  # "none" | "auto" | "required" | {"type": "function", "function": {"name"}}
    chat_template_kwargs: dict = field(default_factory=dict)  # chat: more variables for the template (vLLM's)


def supports(name: str) -> bool:
    """Whether ``SamplingParams`` has field ``name`` (``n`` and ``logprobs`` come with that engine feature)."""
    return any(f.name == name and f.init for f in dataclasses.fields(SamplingParams))


def parse_completion(body: object, model_name: str, defaults: dict | None = None) -> ParsedRequest:
    """``/v1/completions``: prompt is a string, a list of token ids, or a list of either (one choice each).
    ``defaults``: the model's sampling defaults (``EngineConfig.sampling_defaults``) for the fields the request
    leaves unset."""
    body = _check_body(body, COMPLETION_FIELDS, model_name)
    if "prompt" not in body:
        raise RequestError("'prompt' is required", "prompt")
    prompt = body["prompt"]
    if isinstance(prompt, str) or _is_token_list(prompt):
        prompts = [prompt]
    elif isinstance(prompt, list) and prompt and all(isinstance(p, str) or _is_token_list(p) for p in prompt):
        prompts = list(prompt)
    else:
        raise RequestError("'prompt' must be a string, a list of token ids, or a non-empty list of those",
                           "prompt")
    for p in prompts:
        if len(p) == 0:
            raise RequestError("'prompt' is empty; give at least one token", "prompt")
    logprobs = body.get("logprobs")
    if logprobs is not None and not _is_int(logprobs, 0, MAX_TOP_LOGPROBS):
        raise RequestError(f"'logprobs' must be an integer in [0, {MAX_TOP_LOGPROBS}] or null, got {logprobs!r}",
                           "logprobs")
    req = _common(body, logprobs, max_tokens_field="max_tokens", defaults=defaults)
    req.prompts = prompts
    return req


def parse_chat(body: object, model_name: str, defaults: dict | None = None) -> ParsedRequest:
    """``/v1/chat/completions``: ``messages`` are rendered later with the model's chat template (``defaults``: as
    for :func:`parse_completion`)."""
    body = _check_body(body, CHAT_FIELDS, model_name)
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise RequestError("'messages' must be a non-empty list of {'role', 'content'} objects", "messages")
    clean = [_message(i, m) for i, m in enumerate(messages)]
    want = body.get("logprobs")
    if want is not None and not isinstance(want, bool):
        raise RequestError(f"'logprobs' must be true or false, got {want!r}", "logprobs")
    top = body.get("top_logprobs")
    if top is not None:
        if not _is_int(top, 0, MAX_TOP_LOGPROBS):
            raise RequestError(f"'top_logprobs' must be an integer in [0, {MAX_TOP_LOGPROBS}], got {top!r}",
                               "top_logprobs")
        if not want:
            raise RequestError("'top_logprobs' needs 'logprobs': true", "top_logprobs")
    if "max_tokens" in body and "max_completion_tokens" in body:
        raise RequestError("give 'max_completion_tokens' or 'max_tokens', not both", "max_tokens")
    max_field = "max_completion_tokens" if "max_completion_tokens" in body else "max_tokens"
    req = _common(body, (top or 0) if want else None, max_tokens_field=max_field, defaults=defaults)
    req.chat, req.messages = True, clean
    try:
        req.tools = check_tools(body.get("tools") or [])
        choice = body.get("tool_choice")
        req.tool_choice = check_tool_choice(choice if choice is not None else ("auto" if req.tools else "none"),
                                            req.tools)
    except ValueError as e:
        raise RequestError(str(e), "tool_choice" if "tool_choice" in str(e) else "tools") from None
    if not req.tools:
        req.tool_choice = "none"
    forced_call = req.tool_choice not in ("none", "auto")
    if forced_call and req.params.structured_outputs is not None:
        raise RequestError(f"tool_choice {req.tool_choice!r} constrains the answer to a call; it cannot be combined "
                           f"with '{req.structured_field}'", "tool_choice")
    kwargs = body.get("chat_template_kwargs")
    if kwargs is not None:
        if not isinstance(kwargs, dict) or not all(isinstance(k, str) for k in kwargs):
            raise RequestError("'chat_template_kwargs' must be an object of template variables", "chat_template_kwargs")
        req.chat_template_kwargs = kwargs
    parallel = body.get("parallel_tool_calls")
    if parallel is not None and not isinstance(parallel, bool):
        raise RequestError("'parallel_tool_calls' must be true or false", "parallel_tool_calls")
    return req


def _message(i: int, m: object) -> dict:
    """One chat message: ``role`` and ``content`` (a string or text parts; may be null on an assistant message
    with ``tool_calls``), ``name``, an assistant's ``tool_calls``, a tool message's ``tool_call_id``."""
    where = f"messages[{i}]"
    if not isinstance(m, dict):
        raise RequestError(f"{where} must be an object with 'role' and 'content'", where)
    extra = sorted(k for k, v in m.items() if k not in ("role", "content", "name", "tool_calls", "tool_call_id")
                   and v is not None)
    if extra:
        raise RequestError(f"{where}.{extra[0]} is not supported (messages take 'role', 'content', 'name', "
                           "'tool_calls', 'tool_call_id')", f"{where}.{extra[0]}")
    role, content = m.get("role"), m.get("content")
    if not isinstance(role, str) or not role:
        raise RequestError(f"{where}.role must be a non-empty string", f"{where}.role")
    if isinstance(content, list):  # content parts: text only
        if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
                   for p in content):
            raise RequestError(f"{where}.content: only text parts ({{'type': 'text', 'text': ...}}) are supported",
                               f"{where}.content")
        content = "".join(p["text"] for p in content)
    calls = m.get("tool_calls")
    if calls is not None:
        if role != "assistant" or not isinstance(calls, list) or not all(
                isinstance(c, dict) and isinstance(c.get("function"), dict)
                and isinstance(c["function"].get("name"), str) for c in calls):
            raise RequestError(f"{where}.tool_calls must be an assistant's list of {{'id', 'type': 'function', "
                               "'function': {'name', 'arguments'}}", f"{where}.tool_calls")
    if content is None and calls:
        content = None
    elif not isinstance(content, str):
        raise RequestError(f"{where}.content must be a string or a list of text parts", f"{where}.content")
    out = {"role": role, "content": content}
    for key in ("name", "tool_call_id"):
        if m.get(key) is not None:
            if not isinstance(m[key], str):
                raise RequestError(f"{where}.{key} must be a string", f"{where}.{key}")
            out[key] = m[key]
    if calls:
        out["tool_calls"] = calls
    return out


def _check_body(body: object, allowed: set[str], model_name: str) -> dict:
    if not isinstance(body, dict):
        raise RequestError("the request body must be a JSON object")
    ignored = []
    for key, value in body.items():
        if key in allowed:
            continue
        if key in NEUTRAL:
            if value not in NEUTRAL[key]:
                raise RequestError(f"'{key}' is not supported by this server (only {NEUTRAL[key][0]!r})", key)
            continue
        ignored.append(key)
    if ignored:
        logger.warning("request fields ignored (not part of this server's API): %s", ", ".join(sorted(ignored)))
        body = {k: v for k, v in body.items() if k not in ignored}
    model = body.get("model")
    if model != model_name:
        raise RequestError(f"the model {model!r} does not exist; this server serves {model_name!r}", "model",
                           status=404, code="model_not_found")
    return body


def _common(body: dict, logprobs: int | None, max_tokens_field: str, defaults: dict | None = None) -> ParsedRequest:
    stream = body.get("stream", False)
    if stream is None:
        stream = False
    if not isinstance(stream, bool):
        raise RequestError(f"'stream' must be true or false, got {stream!r}", "stream")
    include_usage = False
    options = body.get("stream_options")
    if options is not None:
        if not stream:
            raise RequestError("'stream_options' is only allowed with 'stream': true", "stream_options")
        if not isinstance(options, dict) or set(options) - {"include_usage"}:
            raise RequestError("'stream_options' takes only {'include_usage': bool}", "stream_options")
        include_usage = options.get("include_usage", False)
        if not isinstance(include_usage, bool):
            raise RequestError("'stream_options.include_usage' must be true or false",
                               "stream_options.include_usage")
    n = body.get("n", 1)
    n = 1 if n is None else n
    if not _is_int(n, 1, 128):
        raise RequestError(f"'n' must be an integer in [1, 128], got {n!r}", "n")
    if n > 1 and not supports("n"):
        raise RequestError("'n' > 1 is not supported by this engine yet", "n")
    if logprobs is not None and not supports("logprobs"):
        param = "logprobs" if "top_logprobs" not in body else "top_logprobs"
        raise RequestError("'logprobs' is not supported by this engine yet", param)
    defaults = dict(defaults or {})
    default_max_tokens = defaults.pop("max_tokens", None)
    fields = {**defaults, **{name: body[name] for name in _SAMPLING if body.get(name) is not None}}
    max_tokens = body.get(max_tokens_field)
    if max_tokens is not None:
        fields["max_tokens"] = max_tokens
    elif default_max_tokens is not None:  # the model's max_new_tokens (chat then does not fill the context)
        fields["max_tokens"] = default_max_tokens
    if n > 1:
        fields["n"] = n
    if logprobs is not None:
        fields["logprobs"] = logprobs
    names = {"max_tokens": max_tokens_field, "logprobs": "top_logprobs" if "top_logprobs" in body else "logprobs"}
    structured, structured_field = _structured(body)
    if structured is not None:
        fields["structured_outputs"] = structured
    try:
        params = SamplingParams(**fields)
    except ValueError as e:
        raise RequestError(_rename(str(e), names), _param_of(str(e), names)) from None
    except TypeError as e:  # a field SamplingParams does not take
        raise RequestError(str(e)) from None
    # chat's default: up to the context length (unless the model's generation config sets max_new_tokens)
    fill = max_tokens is None and default_max_tokens is None and "messages" in body
    return_metrics = body.get("return_metrics", False)
    if not isinstance(return_metrics, bool):
        raise RequestError(f"'return_metrics' must be true or false, got {return_metrics!r}", "return_metrics")
    return ParsedRequest([], params, n, stream, include_usage, logprobs, fill_max_tokens=fill,
                         structured_field=structured_field, return_metrics=return_metrics)


def _structured(body: dict) -> tuple[StructuredOutputsParams | None, str | None]:
    """The output constraint of a request and the field it came from: ``response_format`` (``json_object``, or
    ``json_schema`` with ``{"name", "schema", "strict"}``), ``structured_outputs`` (vLLM: ``json``, ``regex``,
    ``choice``, ``grammar``, ``json_object``) or vLLM's older ``guided_json`` / ``guided_regex`` / ``guided_choice``
    / ``guided_grammar``. At most one; ``response_format: {"type": "text"}`` is no constraint."""
    given = [k for k in STRUCTURED if body.get(k) is not None
             and not (k == "response_format" and isinstance(body[k], dict) and body[k].get("type") == "text")]
    if not given:
        if "response_format" in body and not isinstance(body["response_format"], (dict, type(None))):
            raise RequestError("'response_format' must be an object", "response_format")
        return None, None
    if len(given) > 1:
        raise RequestError(f"give one output constraint, not {' and '.join(repr(g) for g in given)}", given[1])
    key, value = given[0], body[given[0]]
    try:
        if key == "structured_outputs":
            return StructuredOutputsParams.from_dict(value), key
        if key != "response_format":  # guided_json -> json, ...
            return StructuredOutputsParams(**{key[len("guided_"):]: value}), key
        return _response_format(value), key
    except ValueError as e:
        raise RequestError(constraint_message(str(e), key), key) from None


def constraint_message(message: str, field: str) -> str:
    """A ``StructuredOutputsParams`` / grammar ``ValueError`` in the words of the request field ``field``."""
    if field == "response_format":
        message = message.replace("structured_outputs.json_schema", "response_format.json_schema")
        message = message.replace("structured_outputs.json ", "response_format.json_schema.schema ")
        return message.replace("structured_outputs", "response_format")
    if field.startswith("guided_"):
        return re.sub(r"structured_outputs(\.\w+)?", field, message, count=1)
    return message


def _response_format(value: object) -> StructuredOutputsParams:
    if not isinstance(value, dict) or value.get("type") not in ("json_object", "json_schema"):
        raise ValueError("structured_outputs 'type' must be 'text', 'json_object' or 'json_schema'")
    if value["type"] == "json_object":
        return StructuredOutputsParams(json_object=True)
    spec = value.get("json_schema")
    if not isinstance(spec, dict) or not isinstance(spec.get("schema"), dict):
        raise ValueError("structured_outputs.json_schema must be an object with a 'schema' object (and 'name', "
                         "'strict')")
    if "strict" in spec and not isinstance(spec["strict"], (bool, type(None))):
        raise ValueError("structured_outputs.json_schema.strict must be true or false")
    return StructuredOutputsParams(json=spec["schema"])


_FIELD = re.compile(r"SamplingParams\.(\w+)")


def _param_of(message: str, names: dict[str, str]) -> str | None:
    m = _FIELD.search(message)
    return names.get(m.group(1), m.group(1)) if m else None


def _rename(message: str, names: dict[str, str]) -> str:
    """``SamplingParams.top_p=2 is invalid`` -> ``top_p=2 is invalid`` with the request's own field name."""
    return _FIELD.sub(lambda m: names.get(m.group(1), m.group(1)), message)


def _is_int(x: object, low: int, high: int) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and low <= x <= high


def _is_token_list(x: object) -> bool:
    return isinstance(x, list) and bool(x) and all(isinstance(t, int) and not isinstance(t, bool) for t in x)
