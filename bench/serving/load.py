"""Serving benchmark: a bounded load generator against ``specdec serve`` on the loopback interface.

For each server configuration (plain, speculative with a fixed k, adaptive speculation) it starts ``specdec serve``
on a free port of 127.0.0.1 (or uses ``--url``, a server already running on loopback), then for each workload and
concurrency level runs ``--requests-per-level`` streaming chat requests with that many clients at once and reports
throughput (completion tokens / wall time of the level), TTFT (request sent -> first content chunk), TPOT
((last chunk - first chunk) / (tokens - 1), per request) and inter-chunk latency (gaps between content chunks: a
verification round that accepts several tokens arrives as one chunk, so this is per chunk, not per token).

``--configs plain,plain-no-prefix-cache --workloads shared-system`` is the prefix-caching A/B (TTFT).
``--soak ROUNDS`` instead runs the same load for several rounds against one server it starts (``--configs``: one,
default adaptive) and reports the server's resident set, errors and KV blocks per round (bench/serving/soak.py).

Workloads: ``classes`` - the bench prompt classes (bench/prompts, one user message each, round-robin);
``shared-system`` - one long system prompt shared by every request, with short distinct user questions (the
prefix-caching workload).

Bounded: at most ``len(concurrency) * requests_per_level`` requests per workload and configuration, each with
``--max-tokens``, and a per-level timeout. Greedy (temperature 0) by default, so every configuration computes the
same tokens.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import statistics
import subprocess
import sys
import time
import urllib.parse
import urllib.request
from pathlib import Path

from bench.common import PROMPT_CLASSES, add_record_flag, load_prompts, machine_info, resolve_model, write_json

SHARED_SYSTEM = (
    "You are a careful senior software engineer at a company that builds data pipelines in Python. Answer in "
    "plain prose, at most three sentences, without code unless asked. Our stack: Python 3.11, pandas, "
    "PostgreSQL 15, Airflow for scheduling, S3 for raw files, and a small FastAPI service for internal tools. "
    "Coding rules: type hints everywhere, small functions, no global state, tests with pytest, logging through "
    "the standard logging module, configuration from environment variables, and no secrets in the repository. "
    "When you are unsure, say so and suggest how to find out."
)
SHARED_QUESTIONS = [
    "How should we name the DAG files?", "Where do database passwords go?", "How do we test a pandas transform?",
    "Should functions log or raise on bad input?", "How small should a function be?",
    "How do we version the FastAPI service?", "What goes into the S3 raw bucket?", "How do we retry a failed task?",
]
CONFIGS = {
    "plain": [],
    "plain-no-prefix-cache": ["--no-prefix-caching"],  # the prefix-caching A/B (not in the default sweep)
    "fixed-k": ["--speculative-method", "{method}", "--num-speculative-tokens", "{k}"],
    "adaptive": ["--speculative-method", "{method}", "--num-speculative-tokens", "{k}", "--adaptive"],
}


def percentile(xs: list[float], q: float) -> float:
    if not xs:
        return float("nan")
    xs = sorted(xs)
    i = (len(xs) - 1) * q
    lo, hi = int(i), min(int(i) + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (i - lo)


def workloads(per_class: int) -> dict[str, list[list[dict]]]:
    prompts = load_prompts(list(PROMPT_CLASSES), per_class)
    mix = [p for i in range(per_class) for cls in PROMPT_CLASSES for p in prompts[cls][i:i + 1]]
    return {
        "classes": [[{"role": "user", "content": p.text}] for p in mix],
        "shared-system": [[{"role": "system", "content": SHARED_SYSTEM}, {"role": "user", "content": q}]
                          for q in SHARED_QUESTIONS],
    }


async def one_request(client, model: str, messages: list[dict], max_tokens: int, temperature: float) -> dict:
    start = time.perf_counter()
    times: list[float] = []
    usage, finish = None, None
    stream = await client.chat.completions.create(
        model=model, messages=messages, max_tokens=max_tokens, temperature=temperature, seed=0, stream=True,
        stream_options={"include_usage": True})
    async for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        if chunk.choices and chunk.choices[0].delta.content:
            times.append(time.perf_counter())
        if chunk.choices and chunk.choices[0].finish_reason:
            finish = chunk.choices[0].finish_reason
    end = time.perf_counter()
    tokens = usage.completion_tokens if usage else 0
    return {"ttft": times[0] - start if times else None,
            "tpot": (times[-1] - times[0]) / (tokens - 1) if len(times) > 1 and tokens > 1 else None,
            "itl": [b - a for a, b in zip(times, times[1:])], "tokens": tokens, "latency": end - start,
            "finish_reason": finish}


async def run_level(url: str, model: str, requests: list[list[dict]], concurrency: int, max_tokens: int,
                    temperature: float, timeout: float) -> dict:
    import openai

    client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=timeout)
    queue: asyncio.Queue = asyncio.Queue()
    for messages in requests:
        queue.put_nowait(messages)
    results: list[dict] = []

    async def worker() -> None:
        while not queue.empty():
            messages = queue.get_nowait()
            results.append(await one_request(client, model, messages, max_tokens, temperature))

    start = time.perf_counter()
    try:
        await asyncio.wait_for(asyncio.gather(*(worker() for _ in range(concurrency))), timeout)
    finally:
        await client.close()
    wall = time.perf_counter() - start
    tokens = sum(r["tokens"] for r in results)

    def stats(xs: list[float]) -> dict:
        return {"p50": percentile(xs, 0.5), "p90": percentile(xs, 0.9), "p99": percentile(xs, 0.99),
                "mean": statistics.fmean(xs) if xs else float("nan")}

    return {"concurrency": concurrency, "requests": len(results), "completion_tokens": tokens, "wall_s": wall,
            "throughput_tok_s": tokens / wall,
            "ttft_s": stats([r["ttft"] for r in results if r["ttft"] is not None]),
            "tpot_s": stats([r["tpot"] for r in results if r["tpot"] is not None]),
            "itl_s": stats([x for r in results for x in r["itl"]])}


def check_loopback(url: str) -> None:
    host = urllib.parse.urlparse(url).hostname
    if host not in ("127.0.0.1", "localhost", "::1"):
        raise SystemExit(f"--url must be a loopback address (127.0.0.1, localhost, ::1), got {host!r}")


def server_flags(args, config: str) -> list[str]:
    """The ``specdec serve`` flags of ``config`` (plus ``--tensor-parallel-size`` when it is > 1)."""
    flags = [f.format(method=args.method, k=args.k) for f in CONFIGS[config]]
    if args.tensor_parallel_size > 1:
        flags += ["--tensor-parallel-size", str(args.tensor_parallel_size)]
    return flags


def start_server(model: str, config: list[str], port: int, threads: int, max_model_len: int, log: Path
                 ) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "specdec", "serve", model, "--served-model-name", "bench", "--port", str(port),
           "--threads", str(threads), "--dtype", "float32", "--max-model-len", str(max_model_len), *config]
    proc = subprocess.Popen(cmd, stdout=log.open("w"), stderr=subprocess.STDOUT,
                            env={**os.environ, "OMP_NUM_THREADS": str(threads)})
    deadline = time.monotonic() + 300
    while True:
        if proc.poll() is not None:
            raise SystemExit(f"the server exited ({proc.returncode}); see {log}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2):
                return proc
        except OSError:
            if time.monotonic() > deadline:
                proc.kill()
                raise SystemExit("the server did not come up in 300 s") from None
            time.sleep(0.2)


def scrape(url: str) -> dict[str, float]:
    """The speculative gauges of /metrics (acceptance, tokens per round) for the record."""
    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(f"{url}/metrics", timeout=10) as r:
        text = r.read().decode()
    wanted = ("specdec_spec_decode_acceptance_rate", "specdec_spec_decode_mean_tokens_per_round",
              "specdec_generation_tokens_total")
    return {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples if s.name in wanted}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.serving.load", description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2", help="folder, or smollm2 | qwen-0.5b | qwen-1.5b")
    parser.add_argument("--url", default=None, help="a server already running on loopback (one configuration)")
    parser.add_argument("--configs", default=None,
                        help="comma-separated: " + ",".join(CONFIGS) + " (default: plain,fixed-k,adaptive; adaptive "
                             "with --soak)")
    parser.add_argument("--method", default="prompt_lookup", help="speculative method of fixed-k / adaptive")
    parser.add_argument("--k", type=int, default=4)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 4])
    parser.add_argument("--requests-per-level", type=int, default=8)
    parser.add_argument("--workloads", default="classes,shared-system")
    parser.add_argument("--prompts-per-class", type=int, default=2)
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--threads", type=int, default=1, help="torch threads of the server (per rank)")
    parser.add_argument("--tensor-parallel-size", type=int, default=1,
                        help="specdec serve --tensor-parallel-size: shard the server's model over N ranks")
    parser.add_argument("--max-model-len", type=int, default=2048)
    parser.add_argument("--level-timeout", type=float, default=600.0, help="seconds one concurrency level may take")
    parser.add_argument("--soak", type=int, default=None, metavar="ROUNDS",
                        help="soak: ROUNDS rounds of --soak-requests at --soak-concurrency plus a --soak-burst, the "
                             "server's RSS per round (one config; needs a server this script starts)")
    parser.add_argument("--soak-requests", type=int, default=240)
    parser.add_argument("--soak-concurrency", type=int, default=32)
    parser.add_argument("--soak-burst", type=int, default=160, help="requests sent at once after each round's load")
    add_record_flag(parser)
    args = parser.parse_args(argv)
    if args.soak is not None:
        from bench.serving.soak import soak_main

        return soak_main(args, argv)
    args.configs = args.configs or "plain,fixed-k,adaptive"
    all_work = workloads(args.prompts_per_class)
    chosen = {name: all_work[name] for name in args.workloads.split(",")}
    configs = [c for c in args.configs.split(",")] if args.url is None else ["external"]
    for c in configs:
        if c not in CONFIGS and c != "external":
            raise SystemExit(f"unknown config {c!r}; choose from {list(CONFIGS)}")
    model = resolve_model(args.model) if args.url is None else None
    rows, results = [], {}
    for config in configs:
        proc = None
        if args.url is None:
            port = _free_port()
            flags = server_flags(args, config)
            log = Path("bench/out") / f"serve-{config}.log"
            log.parent.mkdir(parents=True, exist_ok=True)
            proc = start_server(model, flags, port, args.threads, args.max_model_len, log)
            url = f"http://127.0.0.1:{port}"
        else:
            check_loopback(args.url)
            url = args.url.rstrip("/")
        try:
            served = "bench" if proc else json.loads(urllib.request.urlopen(f"{url}/v1/models").read())["data"][0]["id"]
            asyncio.run(run_level(url, served, chosen[next(iter(chosen))][:1], 1, 4, args.temperature, 120))  # warm
            for work, convs in chosen.items():
                for c in args.concurrency:
                    requests = [convs[i % len(convs)] for i in range(args.requests_per_level)]
                    r = asyncio.run(run_level(url, served, requests, c, args.max_tokens, args.temperature,
                                              args.level_timeout))
                    results.setdefault(config, {}).setdefault(work, []).append(r)
                    rows.append((config, work, r))
                    print(_row(config, work, r), flush=True)
            results.setdefault(config, {})["metrics"] = scrape(url)
        finally:
            if proc is not None:
                proc.send_signal(signal.SIGINT)
                try:
                    proc.wait(30)
                except subprocess.TimeoutExpired:
                    proc.kill()
    print("\n" + table(rows))
    meta = {**machine_info(), "server_threads": args.threads, "model": model or args.url,
            "command": "python -m bench.serving.load " + " ".join(sys.argv[1:] if argv is None else argv),
            **{k: getattr(args, k) for k in ("method", "k", "concurrency", "requests_per_level", "max_tokens",
                                             "temperature", "prompts_per_class")}}
    path = write_json(f"serve-{time.strftime('%Y%m%d-%H%M%S')}", {"meta": meta, "results": results},
                      record=args.record)
    print(f"\nwrote {path}")
    return 0


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _row(config: str, work: str, r: dict) -> str:
    ms = lambda d: f"{1e3 * d['p50']:.0f}/{1e3 * d['p90']:.0f}/{1e3 * d['p99']:.0f}"  # noqa: E731
    return (f"| {config} | {work} | {r['concurrency']} | {r['requests']} | {r['throughput_tok_s']:.1f} | "
            f"{ms(r['ttft_s'])} | {ms(r['tpot_s'])} | {ms(r['itl_s'])} |")


def table(rows: list[tuple[str, str, dict]]) -> str:
    head = ("| config | workload | concurrency | requests | tokens/s | TTFT ms p50/p90/p99 | TPOT ms p50/p90/p99 | "
            "inter-chunk ms p50/p90/p99 |\n|---|---|---|---|---|---|---|---|")
    return "\n".join([head] + [_row(*row) for row in rows])


if __name__ == "__main__":
    sys.exit(main())
