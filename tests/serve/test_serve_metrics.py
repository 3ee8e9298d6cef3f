"""The server's latency histograms (``ServerMetrics``): time to first token and end-to-end latency once per
request, the inter-token latency once per generated token after the first, a multi-token step (a verified round)
spread over its tokens. Fed directly, with a fake clock."""

from __future__ import annotations

import pytest
from prometheus_client.parser import text_string_to_metric_families

from specdec.outputs import CompletionOutput, RequestOutput
from specdec.serve.metrics import ServerMetrics


def output(request_id: str, tokens: int, finished: bool = False, ttft: float | None = 0.25,
           wall: float | None = None) -> RequestOutput:
    metrics = {"time_to_first_token": ttft, "wall_time": wall if finished else None}
    return RequestOutput(request_id, None, [1, 2], [CompletionOutput(0, "", list(range(tokens)),
                                                                     "length" if finished else None)],
                         finished, metrics)


def histogram(metrics: ServerMetrics, name: str) -> dict[str, float]:
    """``{"count": n, "sum": s}`` of histogram ``name``."""
    for family in text_string_to_metric_families(metrics.render().decode()):
        if family.name == name:
            return {s.name.rsplit("_", 1)[1]: s.value for s in family.samples if s.name.endswith(("_count", "_sum"))}
    raise AssertionError(f"{name} is not exported")


def test_latency_histograms_count_requests_and_tokens():
    m = ServerMetrics("tiny")
    # request a: 1 token at t=1, 4 more at t=2 (one verified round), 1 more at t=2.5, finished after 3 s
    m.on_output(output("a", 1), new_prompt_tokens=2, new_tokens=1, now=1.0)
    m.on_output(output("a", 5), 0, 4, now=2.0)
    final = output("a", 6, finished=True, wall=3.0)
    m.on_output(final, 0, 1, now=2.5)
    m.on_finished(final)
    # request b: its first step brings 3 tokens at once (they arrive together: 2 gaps of 0)
    m.on_output(output("b", 3, ttft=0.5), 2, 3, now=5.0)
    ttft = histogram(m, "specdec_time_to_first_token_seconds")
    itl = histogram(m, "specdec_inter_token_latency_seconds")
    e2e = histogram(m, "specdec_e2e_request_latency_seconds")
    assert ttft == {"count": 2, "sum": pytest.approx(0.75)}
    assert itl["count"] == 4 + 1 + 2  # every token after each request's first
    assert itl["sum"] == pytest.approx(4 * 0.25 + 0.5 + 0.0)  # a's round: 1 s over 4 tokens
    assert e2e == {"count": 1, "sum": pytest.approx(3.0)}  # b has not finished
    assert "a" not in m._last_token_time and "b" in m._last_token_time  # finished requests are forgotten
