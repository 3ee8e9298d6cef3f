"""What generate() and step() return (vLLM's shape)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class CompletionOutput:
    index: int
    text: str  # while streaming: the text safe to show (no partial UTF-8, no possible stop-string prefix)
    token_ids: list[int]
    finish_reason: str | None  # "stop" | "length" | "abort" | "error" | None while running


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    metrics: dict = field(default_factory=dict)  # definitions in docs/metrics.md
    error: str | None = None  # why the request failed, when finish_reason is "error"
