"""What generate() and step() return (vLLM's shape)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class CompletionOutput:
    index: int
    text: str  # while streaming: the text safe to show (no partial UTF-8, no possible stop-string prefix)
    token_ids: list[int]
    finish_reason: str | None  # "stop" | "length" | "abort" | "error" | None while running
    # SamplingParams.logprobs set: per token of token_ids, {token id: log-probability} - the top-N tokens in
    # descending order, then the token itself if not among them (vLLM's SampleLogprobs; docs/metrics.md)
    logprobs: list[dict[int, float]] | None = None
    cumulative_logprob: float | None = None  # sum of the tokens' own log-probabilities (when logprobs are set)


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]  # one per sample (SamplingParams.n), outputs[i].index == i
    finished: bool
    metrics: dict = field(default_factory=dict)  # definitions in docs/metrics.md
    error: str | None = None  # why the request failed, when finish_reason is "error"
