"""Tool calls (OpenAI's ``tools`` / ``tool_choice``): the format a model writes calls in, the constraint that makes it
write one, and the parser that turns its text into ``tool_calls``.

Formats, picked from the chat template (``tool_format``):

- ``hermes`` (Qwen2.5 and other templates that mention ``<tool_call>``): the template renders ``tools``; a call is
  ``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>``, several may follow each other.
- ``llama3_json`` (Llama 3.1+ templates, which mention ``<|python_tag|>`` or ``ipython``): the template renders
  ``tools``; a call is the whole answer, ``{"name": ..., "parameters": {...}}``.
- ``generic`` (templates with no tools section, e.g. the default SmolLM2's): specdec adds a system message that
  lists the tools as JSON and asks for ``{"name": ..., "arguments": {...}}``; previous calls and tool results are
  rendered as plain assistant and tool turns.

``tool_choice`` "required" and a named function constrain the answer to a call of the allowed tools (a grammar:
the arguments follow each tool's ``parameters`` schema, spelled as ``json.dumps`` writes JSON); "auto" leaves the
model free and parses what it wrote; "none" leaves tools out of the prompt.
"""

from __future__ import annotations

import json
import re
import uuid

from specdec.structured.params import StructuredOutputsParams

FORMATS = ("hermes", "llama3_json", "generic")
# a call's JSON as json.dumps writes it - '{"name": "f", "arguments": {"a": 1}}' - with no other whitespace: the
# spelling models are trained on, and no room for a model to run on in whitespace (llguidance's JSON options)
COMPACT_JSON = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
GENERIC_SYSTEM = (
    "You can call these tools (JSON schemas of their arguments):\n{tools}\n"
    'To call one, answer with only a JSON object {{"name": <tool name>, "arguments": {{...}}}}.'
)


def tool_format(chat_template: str | None) -> str:
    """The call format of a chat template (module docstring)."""
    template = chat_template or ""
    if "<tool_call>" in template:
        return "hermes"
    if "<|python_tag|>" in template or "ipython" in template:
        return "llama3_json"
    return "generic"


def check_tools(tools: object) -> list[dict]:
    """OpenAI's ``tools``: ``[{"type": "function", "function": {"name", "description"?, "parameters"?}}]``, or
    ``ValueError`` naming what is wrong."""
    if not isinstance(tools, list):
        raise ValueError("'tools' must be a list of {'type': 'function', 'function': {...}} objects")
    names = set()
    for i, tool in enumerate(tools):
        fn = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(tool, dict) or tool.get("type") != "function" or not isinstance(fn, dict):
            raise ValueError(f"tools[{i}] must be {{'type': 'function', 'function': {{'name', 'parameters'}}}}")
        name = fn.get("name")
        if not isinstance(name, str) or not re.fullmatch(r"[A-Za-z0-9_.-]{1,64}", name):
            raise ValueError(f"tools[{i}].function.name must be 1-64 letters, digits, '_', '.' or '-'")
        if name in names:
            raise ValueError(f"tools[{i}].function.name {name!r} is given twice")
        names.add(name)
        params = fn.get("parameters")
        if params is not None and not isinstance(params, dict):
            raise ValueError(f"tools[{i}].function.parameters must be a JSON schema object")
    return tools


def check_tool_choice(choice: object, tools: list[dict]) -> str | dict:
    """``"none"``, ``"auto"``, ``"required"`` or ``{"type": "function", "function": {"name": <a tool>}}``."""
    if choice in ("none", "auto", "required"):
        if choice == "required" and not tools:
            raise ValueError("tool_choice 'required' needs 'tools'")
        return choice
    if isinstance(choice, dict) and choice.get("type") == "function" and isinstance(choice.get("function"), dict):
        name = choice["function"].get("name")
        if not isinstance(name, str) or name not in {t["function"]["name"] for t in tools}:
            raise ValueError(f"tool_choice names {name!r}, which is not one of 'tools'")
        return choice
    raise ValueError("tool_choice must be 'none', 'auto', 'required' or {'type': 'function', 'function': "
                     "{'name': ...}}")


def render_messages(messages: list[dict], tools: list[dict], fmt: str) -> list[dict]:
    """The messages the chat template renders: for templates with a tools section as given, a previous call's
    ``arguments`` (OpenAI sends a JSON string) as an object; for ``generic`` the tools as a system message and
    previous calls / results as plain turns."""
    if fmt != "generic":  # templates read a call's arguments as an object (transformers' convention)
        return [{**m, "tool_calls": [{**c, "function": {**c["function"],
                                                         "arguments": _arguments(c["function"].get("arguments"))}}
                                     for c in m["tool_calls"]]} if m.get("tool_calls") else m for m in messages]
    out = []
    if tools:
        listed = json.dumps([t["function"] for t in tools], ensure_ascii=False)
        system = GENERIC_SYSTEM.format(tools=listed)
        if messages and messages[0]["role"] == "system":
            out.append({"role": "system", "content": messages[0]["content"] + "\n\n" + system})
            messages = messages[1:]
        else:
            out.append({"role": "system", "content": system})
    for m in messages:
        if m.get("tool_calls"):
            calls = [{"name": c["function"]["name"], "arguments": _arguments(c["function"].get("arguments"))}
                     for c in m["tool_calls"]]
            text = "\n".join(json.dumps(c, ensure_ascii=False) for c in calls)
            out.append({"role": "assistant", "content": ((m.get("content") or "") + "\n" + text).strip()})
        elif m["role"] == "tool":
            out.append({"role": "tool", "content": m.get("content") or ""})
        else:
            out.append({"role": m["role"], "content": m.get("content") or ""})
    return out


def call_constraint(tools: list[dict], choice: str | dict, fmt: str, tag_ids: tuple[int, int] | None = None
                    ) -> StructuredOutputsParams | None:
    """The grammar a "required" or named ``tool_choice`` puts on the answer (None for "auto" / "none").
    ``tag_ids``: the token ids of ``<tool_call>`` and ``</tool_call>`` where the tokenizer has them as tokens
    (Qwen2.5's are special tokens, which a text literal in a grammar never matches); None: spelled as text."""
    if choice in ("auto", "none"):
        return None
    allowed = tools if choice == "required" else [t for t in tools if t["function"]["name"] ==
                                                  choice["function"]["name"]]
    key = "parameters" if fmt == "llama3_json" else "arguments"
    options = [{"type": "object", "additionalProperties": False, "required": ["name", key],
                "properties": {"name": {"const": t["function"]["name"]},
                               key: t["function"].get("parameters") or {"type": "object"}}} for t in allowed]
    schema = options[0] if len(options) == 1 else {"anyOf": options}
    schema = {**schema, "x-guidance": COMPACT_JSON}
    if fmt == "hermes":
        open_tag, close_tag = (f"<[{tag_ids[0]}]>", f"<[{tag_ids[1]}]>") if tag_ids else ('"<tool_call>"',
                                                                                          '"</tool_call>"')
        return StructuredOutputsParams(grammar=f'start: {open_tag} "\\n" call "\\n" {close_tag}\ncall: %json '
                                       + json.dumps(schema))
    return StructuredOutputsParams(json=schema)


def parse_calls(text: str, fmt: str, tools: list[dict]) -> tuple[str | None, list[dict]]:
    """(the text that is not a call or None, OpenAI ``tool_calls``) from a model's answer. Only calls of the given
    tools with object arguments count; anything else stays text."""
    names = {t["function"]["name"] for t in tools}
    found: list[tuple[str, dict]] = []
    rest = text
    if fmt == "hermes":
        pieces = []
        last = 0
        for m in re.finditer(r"<tool_call>\s*(.*?)\s*</tool_call>", text, re.S):
            call = _call(m.group(1), "arguments", names)
            if call is None:
                continue
            found.append(call)
            pieces.append(text[last:m.start()])
            last = m.end()
        rest = "".join(pieces) + text[last:]
        if not found:  # the tags are special tokens the detokenizer drops: calls as bare JSON, one per line
            lines = [line for line in text.splitlines() if line.strip()]
            bare = [_call(line, "arguments", names) for line in lines] or [None]
            if all(call is not None for call in bare):
                found, rest = bare, ""
    else:
        key = "parameters" if fmt == "llama3_json" else "arguments"
        body = text.strip().removeprefix("<|python_tag|>").strip()
        call = _call(body, key, names)
        if call is not None:
            found, rest = [call], ""
    calls = [{"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
              "function": {"name": name, "arguments": json.dumps(args, ensure_ascii=False)}} for name, args in found]
    rest = rest.strip()
    return (rest or None) if calls else text, calls


def _call(source: str, key: str, names: set[str]) -> tuple[str, dict] | None:
    try:
        value = json.loads(source)
    except json.JSONDecodeError:
        return None
    if not isinstance(value, dict) or not isinstance(value.get("name"), str) or value["name"] not in names:
        return None
    args = value.get(key, value.get("arguments", value.get("parameters", {})))
    return (value["name"], args) if isinstance(args, dict) else None


def _arguments(arguments: object) -> object:
    """A previous call's arguments as sent back by a client: a JSON string (OpenAI's shape) or an object."""
    if isinstance(arguments, str):
        try:
            return json.loads(arguments)
        except json.JSONDecodeError:
            return arguments
    return arguments if arguments is not None else {}
