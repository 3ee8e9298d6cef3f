"""Prometheus metrics of the server (``/metrics``), fed by the engine loop thread (names in docs/api.md).

Counters add up per-request counters (``RequestOutput.metrics``, docs/metrics.md) when a request finishes;
the acceptance gauges are ratios of those sums, so they weigh every drafted token equally (vLLM's system
acceptance rate), not every request. Latency histograms (vLLM's three): time to first token and end-to-end
latency per request, and the inter-token latency per generated token after the first - a step that emits k tokens
at once (a verified round) counts k tokens, each at the step's gap over k, so speculation shows as what a streaming
client sees per token.
"""

from __future__ import annotations

import threading
import time

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from specdec.outputs import RequestOutput

PREFIX = "specdec"
# seconds; vLLM's buckets for the same histograms, cut to what a CPU or a GPU engine can show
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                40.0, 80.0)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4,
               0.5, 0.75, 1.0, 2.5, 5.0)
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
               480.0, 960.0)


class ServerMetrics:
    """One registry per server (tests run several servers in one process)."""

    content_type = CONTENT_TYPE_LATEST

    def __init__(self, model_name: str):
        self.registry = CollectorRegistry()
        r, p = self.registry, PREFIX
        self.running = Gauge(f"{p}_num_requests_running", "sequences in the running batch", registry=r)
        self.waiting = Gauge(f"{p}_num_requests_waiting", "sequences waiting to be scheduled (preempted included)",
                             registry=r)
        self.kv_used = Gauge(f"{p}_kv_cache_blocks_used", "target KV-cache blocks not free", registry=r)
        self.kv_total = Gauge(f"{p}_kv_cache_blocks_total", "target KV-cache blocks in the pool", registry=r)
        self.kv_usage = Gauge(f"{p}_kv_cache_usage_ratio", "kv_cache_blocks_used / kv_cache_blocks_total",
                              registry=r)
        self.cache_queries = Counter(f"{p}_prefix_cache_queries", "prompt tokens looked up in the prefix cache",
                                     registry=r)
        self.cache_hits = Counter(f"{p}_prefix_cache_hits", "prompt tokens served from the prefix cache (not computed)",
                                  registry=r)
        self._cache_seen = [0, 0]  # engine counters already added (queries, hits)
        self.prompt_tokens = Counter(f"{p}_prompt_tokens", "prompt tokens of admitted requests", registry=r)
        self.generation_tokens = Counter(f"{p}_generation_tokens", "tokens generated", registry=r)
        self.finished = Counter(f"{p}_requests_finished", "finished sequences by finish reason",
                                ["finish_reason"], registry=r)
        self.rejected = Counter(f"{p}_requests_rejected", "HTTP requests refused by status (400, 404, 503)",
                                ["status"], registry=r)
        self.drafted = Counter(f"{p}_spec_decode_draft_tokens", "draft tokens proposed (finished requests)",
                               registry=r)
        self.accepted = Counter(f"{p}_spec_decode_accepted_tokens", "draft tokens accepted (finished requests)",
                                registry=r)
        self.rounds = Counter(f"{p}_spec_decode_rounds", "verification rounds (finished requests)", registry=r)
        self.round_tokens = Counter(f"{p}_spec_decode_round_tokens",
                                    "tokens emitted by verification rounds, correction/bonus included", registry=r)
        self.acceptance_rate = Gauge(f"{p}_spec_decode_acceptance_rate", "accepted / drafted over finished requests",
                                     registry=r)
        self.tokens_per_round = Gauge(f"{p}_spec_decode_mean_tokens_per_round",
                                      "round tokens / rounds over finished requests (tau)", registry=r)
        self.position_acceptance = Gauge(f"{p}_spec_decode_per_position_acceptance",
                                         "rounds that accepted draft i / rounds that drafted a token at i",
                                         ["position"], registry=r)
        self.ttft = Histogram(f"{p}_time_to_first_token_seconds", "arrival to first generated token, per request",
                              buckets=TTFT_BUCKETS, registry=r)
        self.itl = Histogram(f"{p}_inter_token_latency_seconds",
                             "gap between generated tokens, per token after the first (a step's gap / its tokens)",
                             buckets=ITL_BUCKETS, registry=r)
        self.e2e = Histogram(f"{p}_e2e_request_latency_seconds", "arrival to finish, per request",
                             buckets=E2E_BUCKETS, registry=r)
        self._last_token_time: dict[str, float] = {}  # request id -> when its last tokens arrived (loop thread)
        info = Gauge(f"{p}_model_info", "the served model", ["model_name"], registry=r)
        info.labels(model_name=model_name).set(1)
        self._lock = threading.Lock()  # the sums behind the ratio gauges
        self._sums = {"drafted": 0, "accepted": 0, "rounds": 0, "round_tokens": 0}
        self._position: list[list[int]] = []  # [i] = [accepted, drafted]

    # --- called on the engine loop thread ------------------------------------------------------------------
    def on_output(self, out: RequestOutput, new_prompt_tokens: int, new_tokens: int,
                  now: float | None = None) -> None:
        """``new_tokens`` more tokens of ``out`` (all samples together) arrived at ``now`` (perf_counter)."""
        if new_prompt_tokens:
            self.prompt_tokens.inc(new_prompt_tokens)
        if new_tokens <= 0:
            return
        self.generation_tokens.inc(new_tokens)
        now = time.perf_counter() if now is None else now
        last = self._last_token_time.get(out.request_id)
        if last is None:  # the first tokens: TTFT from the request's own clock; the rest of the step's tokens follow
            ttft = (out.metrics or {}).get("time_to_first_token")
            if ttft is not None:
                self.ttft.observe(ttft)
            new_tokens -= 1
            last = now
        for _ in range(new_tokens):
            self.itl.observe((now - last) / new_tokens)
        self._last_token_time[out.request_id] = now

    def on_finished(self, out: RequestOutput, raw=None) -> None:
        """Count a finished request. ``raw``: its ``RequestMetrics`` (exact per-position counts), or None to
        use the summary dict ``out.metrics`` alone (then positions are not counted)."""
        for c in out.outputs:
            self.finished.labels(finish_reason=c.finish_reason or "unknown").inc()
        self._last_token_time.pop(out.request_id, None)
        m = out.metrics or {}
        if m.get("wall_time") is not None:
            self.e2e.observe(m["wall_time"])
        rounds = m.get("num_rounds") or 0
        if not rounds:
            return
        tau = m.get("mean_tokens_per_round") or 0.0
        add = {"drafted": m.get("drafted", 0), "accepted": m.get("accepted", 0), "rounds": rounds,
               "round_tokens": raw.num_round_tokens if raw is not None else round(tau * rounds)}
        with self._lock:
            for key, value in add.items():
                self._sums[key] += value
            for counter, key in ((self.drafted, "drafted"), (self.accepted, "accepted"), (self.rounds, "rounds"),
                                 (self.round_tokens, "round_tokens")):
                counter.inc(add[key])
            s = self._sums
            if s["drafted"]:
                self.acceptance_rate.set(s["accepted"] / s["drafted"])
            self.tokens_per_round.set(s["round_tokens"] / s["rounds"])
            if raw is not None:
                for i, (acc, dr) in enumerate(zip(raw.accepted_per_position, raw.drafted_per_position)):
                    while len(self._position) <= i:
                        self._position.append([0, 0])
                    self._position[i][0] += acc
                    self._position[i][1] += dr
                    if self._position[i][1]:
                        self.position_acceptance.labels(position=str(i)).set(
                            self._position[i][0] / self._position[i][1])

    def on_snapshot(self, snap) -> None:
        self.running.set(snap.num_running)
        self.waiting.set(snap.num_waiting)
        self.kv_used.set(snap.kv_blocks_used)
        self.kv_total.set(snap.kv_blocks_total)
        self.kv_usage.set(snap.kv_blocks_used / snap.kv_blocks_total if snap.kv_blocks_total else 0.0)
        for i, (counter, value) in enumerate(((self.cache_queries, snap.prefix_cache_queries),
                                              (self.cache_hits, snap.prefix_cache_hits))):
            if value > self._cache_seen[i]:
                counter.inc(value - self._cache_seen[i])
                self._cache_seen[i] = value

    # --- HTTP side ------------------------------------------------------------------------------------------
    def render(self) -> bytes:
        return generate_latest(self.registry)
