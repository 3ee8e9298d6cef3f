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

    Checked here for shape only; the grammar itself is compiled and checked when the request is added
    (``GrammarCompiler.compile``), which raises ``ValueError`` naming what is wrong.
    """

    json: dict | str | None = None
    json_object: bool = False
    regex: str | None = None
    choice: list[str] | tuple[str, ...] | None = None
    grammar: str | None = None

    def __post_init__(self) -> None:
        given = [k for k in KINDS if (getattr(self, k) not in (None, False))]
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
        if self.json_object not in (True, False):
            raise ValueError(f"structured_outputs.json_object must be true or false, got {self.json_object!r}")
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
        return next(k for k in KINDS if getattr(self, k) not in (None, False))

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
        return kind, value

    @classmethod
    def from_dict(cls, body: dict) -> StructuredOutputsParams:
        """From a request body's ``structured_outputs`` object (vLLM's keys); unknown keys are refused."""
        if not isinstance(body, dict):
            raise ValueError(f"structured_outputs must be an object, got {type(body).__name__}")
        unknown = sorted(k for k in set(body) - set(KINDS) if body[k] not in (None, False))
        if unknown:
            raise ValueError(f"structured_outputs: {', '.join(unknown)} not supported; allowed: {', '.join(KINDS)}")
        return cls(**{k: body[k] for k in KINDS if k in body})
