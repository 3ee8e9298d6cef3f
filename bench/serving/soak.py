"""Soak of ``specdec serve``: the same load for several rounds against one server, its resident set per round.

Each round: ``requests`` streaming chat requests (the bench prompt classes, greedy) with ``concurrency`` clients at
once, then a burst of ``burst`` requests sent all at once (more than the server's ``max_num_seqs + max_waiting``
can hold, so some are answered 503 - counted, not errors). After the round the soak waits until the server has
nothing running or waiting, then reads its VmRSS (``/proc/PID/status``) and the ``/metrics`` gauge
``specdec_kv_cache_blocks_used`` (0: every block back in the pool, evictable prefix-cache blocks counting as free).
An error is a request that failed other than with 503, or that finished with ``finish_reason "error"``.

    python -m bench.serving.load --soak 4 [--soak-requests 240 --concurrency 32 --soak-burst 160 --max-tokens 32]

Growth that continues after the first round (warm-up: compiled kernels, allocator pools) is what a leak looks like.
"""

from __future__ import annotations

import argparse
import asyncio
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from bench.common import machine_info, resolve_model, write_json
from bench.serving.load import CONFIGS, _free_port, one_request, run_level, server_flags, start_server, workloads


def vm_rss_mib(pid: int) -> float:
    """The resident set of process ``pid`` (``VmRSS`` of /proc/PID/status), in MiB."""
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise ValueError(f"no VmRSS in /proc/{pid}/status")


def gauges(url: str) -> dict[str, float]:
    """Every unlabelled sample of the server's /metrics."""
    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(f"{url}/metrics", timeout=10) as r:
        text = r.read().decode()
    return {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples if not s.labels}


def wait_idle(url: str, timeout: float = 120.0) -> dict[str, float]:
    """The /metrics gauges once nothing runs or waits (``TimeoutError`` if that takes more than ``timeout`` s)."""
    deadline = time.monotonic() + timeout
    while True:
        g = gauges(url)
        if g.get("specdec_num_requests_running", 0) == 0 and g.get("specdec_num_requests_waiting", 0) == 0:
            return g
        if time.monotonic() > deadline:
            raise TimeoutError(f"the server is still busy after {timeout} s: {g}")
        time.sleep(0.2)


async def soak_round(url: str, model: str, convs: list[list[dict]], requests: int, concurrency: int, burst: int,
                     max_tokens: int, timeout: float) -> dict:
    """One round's load; returns counts {"ok", "rejected_503", "errors", "tokens"} and the first error messages."""
    import openai

    client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=timeout)
    counts = {"ok": 0, "rejected_503": 0, "errors": 0, "tokens": 0}
    messages: list[str] = []

    async def one(conv: list[dict]) -> None:
        try:
            r = await one_request(client, model, conv, max_tokens, 0.0)
        except openai.APIStatusError as e:
            counts["rejected_503" if e.status_code == 503 else "errors"] += 1
            if e.status_code != 503:
                messages.append(f"{e.status_code}: {e.message}"[:200])
            return
        except Exception as e:  # noqa: BLE001 - a soak counts every failure instead of stopping at the first
            counts["errors"] += 1
            messages.append(f"{type(e).__name__}: {e}"[:200])
            return
        counts["ok" if r["finish_reason"] != "error" else "errors"] += 1
        counts["tokens"] += r["tokens"]

    queue = [convs[i % len(convs)] for i in range(requests)]

    async def worker() -> None:
        while queue:
            await one(queue.pop())

    start = time.perf_counter()
    try:
        await asyncio.wait_for(asyncio.gather(*(worker() for _ in range(concurrency))), timeout)
        await asyncio.wait_for(asyncio.gather(*(one(convs[i % len(convs)]) for i in range(burst))), timeout)
    finally:
        await client.close()
    return {**counts, "wall_s": time.perf_counter() - start, "error_messages": messages[:5]}


def soak(url: str, pid: int, model: str, convs: list[list[dict]], rounds: int, requests: int, concurrency: int,
         burst: int, max_tokens: int, timeout: float) -> list[dict]:
    """``rounds`` rounds against the server at ``url`` (process ``pid``); one row per round, printed as it ends."""
    wait_idle(url)
    rss = vm_rss_mib(pid)
    rows = []
    print(f"soak: server RSS {rss:.0f} MiB before round 1", flush=True)
    print(HEADER, flush=True)
    for i in range(1, rounds + 1):
        r = asyncio.run(soak_round(url, model, convs, requests, concurrency, burst, max_tokens, timeout))
        g = wait_idle(url)
        after = vm_rss_mib(pid)
        row = {"round": i, **r, "kv_blocks_used_after": g.get("specdec_kv_cache_blocks_used"),
               "kv_blocks_total": g.get("specdec_kv_cache_blocks_total"), "rss_before_mib": rss,
               "rss_after_mib": after, "rss_grew_mib": after - rss}
        rows.append(row)
        print(soak_row(row), flush=True)
        rss = after
    return rows


def soak_main(args: argparse.Namespace, argv: list[str] | None) -> int:
    if args.url is not None:
        raise SystemExit("--soak starts its own server (it reads the server's /proc/PID/status); drop --url")
    for name, value, low in (("--soak", args.soak, 1), ("--soak-requests", args.soak_requests, 0),
                             ("--soak-concurrency", args.soak_concurrency, 1), ("--soak-burst", args.soak_burst, 0)):
        if value < low:
            raise SystemExit(f"{name} must be >= {low}, got {value}")
    config = args.configs or "adaptive"
    if config not in CONFIGS:
        raise SystemExit(f"--soak runs one config, one of {list(CONFIGS)}; got {config!r}")
    model = resolve_model(args.model)
    port = _free_port()
    log = Path("bench/out") / f"serve-soak-{config}.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    flags = server_flags(args, config)
    proc = start_server(model, flags, port, args.threads, args.max_model_len, log)
    url = f"http://127.0.0.1:{port}"
    convs = workloads(args.prompts_per_class)["classes"]
    try:
        asyncio.run(run_level(url, "bench", convs[:1], 1, 4, 0.0, 120))  # warm
        rows = soak(url, proc.pid, "bench", convs, args.soak, args.soak_requests, args.soak_concurrency,
                    args.soak_burst, args.max_tokens, args.level_timeout)
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
    meta = {**machine_info(), "server_threads": args.threads, "model": model, "config": config,
            "command": "python -m bench.serving.load " + " ".join(sys.argv[1:] if argv is None else argv),
            **{k: getattr(args, k) for k in ("method", "k", "soak", "soak_requests", "soak_concurrency", "soak_burst",
                                             "max_tokens", "prompts_per_class")}}
    path = write_json(f"serve-soak-{time.strftime('%Y%m%d-%H%M%S')}", {"meta": meta, "rounds": rows},
                      record=args.record)
    print(f"\nwrote {path}")
    errors = sum(r["errors"] for r in rows)
    leaked = [r["round"] for r in rows if r["kv_blocks_used_after"]]
    if errors or leaked:
        print(f"soak FAILED: {errors} errors; KV blocks still used after rounds {leaked}")
        return 1
    return 0


HEADER = ("| round | answered | 503 | errors | tokens | wall s | KV blocks used after | RSS before MiB | "
          "RSS after MiB | grew MiB |\n|---|---|---|---|---|---|---|---|---|---|")


def soak_row(r: dict) -> str:
    return (f"| {r['round']} | {r['ok']} | {r['rejected_503']} | {r['errors']} | {r['tokens']} | {r['wall_s']:.0f} | "
            f"{r['kv_blocks_used_after']:.0f} / {r['kv_blocks_total']:.0f} | {r['rss_before_mib']:.0f} | "
            f"{r['rss_after_mib']:.0f} | {r['rss_grew_mib']:+.0f} |")
