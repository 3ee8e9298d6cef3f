"""Prometheus metrics of the server (``/metrics``), fed by the engine loop thread (names in docs/api.md).

Counters add up per-request counters (``RequestOutput.metrics``, docs/metrics.md) when a request finishes;
the acceptance gauges are ratios of those sums, so they weigh every drafted token equally (vLLM's system
acceptance rate), not every request.
"""

from __future__ import annotations

import threading

from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from specdec.outputs import RequestOutput

PREFIX = "specdec"


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
        info = Gauge(f"{p}_model_info", "the served model", ["model_name"], registry=r)
        info.labels(model_name=model_name).set(1)
        self._lock = threading.Lock()  # the sums behind the ratio gauges
        self._sums = {"drafted": 0, "accepted": 0, "rounds": 0, "round_tokens": 0}
        self._position: list[list[int]] = []  # [i] = [accepted, drafted]

    # --- called on the engine loop thread ------------------------------------------------------------------
    def on_output(self, out: RequestOutput, new_prompt_tokens: int, new_tokens: int) -> None:
        if new_prompt_tokens:
            self.prompt_tokens.inc(new_prompt_tokens)
        if new_tokens > 0:
            self.generation_tokens.inc(new_tokens)

    def on_finished(self, out: RequestOutput, raw=None) -> None:
        """Count a finished request. ``raw``: its ``RequestMetrics`` (exact per-position counts), or None to
        use the summary dict ``out.metrics`` alone (then positions are not counted)."""
        for c in out.outputs:
            self.finished.labels(finish_reason=c.finish_reason or "unknown").inc()
        m = out.metrics or {}
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
