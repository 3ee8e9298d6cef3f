"""StructuredOutputsParams: the constraint a request puts on its output (vLLM's ``structured_outputs`` shape)."""

from __future__ import annotations

import json
from dataclasses import dataclass

KINDS = ("json", "json_object", "regex", "choice", "grammar")


@dataclass(frozen=True)
class StructuredOutputsParams:
    """Exactly one of:

    - ``json``: a JSON schema (a dict, or its JSON text); the output is one JSON value valid against it.
    - ``json_object``: True: any JSON object (OpenAI's ``response_format={"type": "json_object"}``).
    - ``regex``: the whole output matches this regular expression (Rust ``regex`` syntax, as llguidance reads it).
    - ``choice``: the output is one of these strings, exactly.
    - ``grammar``: a Lark grammar (llguidance's dialect; ``start`` is the start rule).

    ``disable_any_whitespace`` (vLLM's option; JSON only): no whitespace between JSON tokens (compact output, and
    no chance for a model to run on in whitespace); by default any JSON whitespace is allowed.

    Checked here for shape only; the grammar itself is compiled and checked when the request is added
    (``GrammarCompiler.compile``), which raises ``ValueError`` naming what is wrong.
    """

    json: dict | str | None = None
    json_object: bool = False
    regex: str | None = None
    choice: list[str] | tuple[str, ...] | None = None
    grammar: str | None = None
    disable_any_whitespace: bool = False

    def __post_init__(self) -> None:
        given = [k for k in KINDS if getattr(self, k) is not None and getattr(self, k) is not False]
        if len(given) != 1:
            raise ValueError(f"structured_outputs takes exactly one of {', '.join(KINDS)}; got "
                             f"{', '.join(given) if given else 'none'}")
        if self.json is not None and not isinstance(self.json, (dict, str)):
            raise ValueError(f"structured_outputs.json must be a JSON schema (a dict or its JSON text), got "
                             f"{type(self.json).__name__}")
        if isinstance(self.json, str):
            try:
                schema = json.loads(self.json)
            except json.JSONDecodeError as e:
                raise ValueError(f"structured_outputs.json is not valid JSON: {e}") from None
            if not isinstance(schema, (dict, bool)):
                raise ValueError("structured_outputs.json must be a JSON schema object")
        for name in ("json_object", "disable_any_whitespace"):
            if getattr(self, name) not in (True, False):
                raise ValueError(f"structured_outputs.{name} must be true or false, got {getattr(self, name)!r}")
        if self.disable_any_whitespace and self.kind not in ("json", "json_object"):
            raise ValueError("structured_outputs.disable_any_whitespace applies to json and json_object only")
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise ValueError(f"structured_outputs.{name} must be a non-empty string")
        if self.choice is not None:
            if (not isinstance(self.choice, (list, tuple)) or not self.choice
                    or not all(isinstance(c, str) and c for c in self.choice)):
                raise ValueError("structured_outputs.choice must be a non-empty list of non-empty strings")
            object.__setattr__(self, "choice", tuple(self.choice))

    @property
    def kind(self) -> str:
        return next(k for k in KINDS if getattr(self, k) is not None and getattr(self, k) is not False)

    def key(self) -> tuple[str, str]:
        """A hashable identity of the constraint: the compiled grammar's cache key."""
        kind = self.kind
        if kind == "json":
            value = self.json if isinstance(self.json, str) else json.dumps(self.json, sort_keys=True)
        elif kind == "choice":
            value = json.dumps(list(self.choice))
        elif kind == "json_object":
            value = ""
        else:
            value = getattr(self, kind)
        return kind + (" compact" if self.disable_any_whitespace else ""), value

    @classmethod
    def from_dict(cls, body: dict) -> StructuredOutputsParams:
        """From a request body's ``structured_outputs`` object (vLLM's keys); unknown keys are refused."""
        if not isinstance(body, dict):
            raise ValueError(f"structured_outputs must be an object, got {type(body).__name__}")
        options = ("disable_any_whitespace",)
        unknown = sorted(k for k in set(body) - set(KINDS) - set(options) if body[k] is not None
                         and body[k] is not False)
        if unknown:
            raise ValueError(f"structured_outputs: {', '.join(unknown)} not supported; allowed: "
                             f"{', '.join(KINDS + options)}")
        return cls(**{k: body[k] for k in KINDS + options if k in body and body[k] is not None})
