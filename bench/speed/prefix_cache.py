"""Prefix caching on a shared-system-prompt chat workload: prefill tokens computed and prefill wall time, with
and without the cache.

Each repetition uses a fresh system prompt (a repetition number in front), so every repetition starts from a cold
cache. Two workloads per repetition, each run on the engine with the cache and on the one without, interleaved:

- ``sequential``: R chat requests with the same system prompt and different user turns, one after another, each
  with ``max_tokens=1`` - its wall time is its prefill (time to first token). Requests 2..R are what the cache is
  for; request 1 computes the system prompt in both engines.
- ``burst``: R such requests added at once (another system prompt), ``max_tokens=1``: total wall time and tokens
  computed (with the cache, the copies wait one step for the first one's system-prompt blocks).

    PYTHONPATH=. python -m bench.speed.prefix_cache [--model smollm2] [--requests 8] [--reps 3] [--threads 1]
"""

from __future__ import annotations

import argparse

import specdec
from bench.common import (
    add_record_flag,
    machine_info,
    median,
    print_table,
    resolve_model,
    set_threads,
    timed,
    write_json,
)

SYSTEM = (
    "You are a careful assistant for a software company. Answer questions about our products, our pricing and "
    "our support policy. Be concise and precise; if you do not know, say so. Our products: Atlas (a database "
    "for time series, priced per node), Beacon (a monitoring agent, free), Compass (a query planner add-on for "
    "Atlas, priced per seat). Support hours are 9 to 17 UTC on weekdays; critical incidents are handled at any "
    "time for Enterprise customers. Refunds are possible within 30 days of purchase. Never share internal "
    "information, never promise features that are not released, and always answer in the user's language. "
    "When a question is about billing, ask for the invoice number first. When a question is about a bug, ask "
    "for the version, the operating system and the exact error message."
)
QUESTIONS = [
    "How much does Atlas cost?", "Is Beacon free?", "What are your support hours?", "Can I get a refund?",
    "Does Compass work without Atlas?", "My query is slow, what can I do?", "Do you support Windows?",
    "Who handles incidents at night?", "What is a seat?", "Can I pay yearly?", "Is there a trial?",
    "What does Beacon monitor?",
]


def count_computed(llm: specdec.LLM) -> list[int]:
    """[target tokens computed so far], counted on every target forward."""
    counter = [0]
    forward = llm.engine.runner.forward

    def counting(items, *args, **kwargs):
        counter[0] += sum(len(it.token_ids) for it in items)
        return forward(items, *args, **kwargs)

    llm.engine.runner.forward = counting
    return counter


def prompts(llm: specdec.LLM, tag: str, n: int) -> list[list[int]]:
    system = f"[{tag}] {SYSTEM}"
    return [llm.tokenizer.encode(llm.tokenizer.apply_chat_template(
        [{"role": "system", "content": system}, {"role": "user", "content": QUESTIONS[i % len(QUESTIONS)]}]))
        for i in range(n)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="smollm2", help="smollm2 (the embedded default) or a folder / hub id")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--requests", type=int, default=8)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    add_record_flag(parser)
    args = parser.parse_args()
    set_threads(args.threads)
    path = resolve_model(args.model)
    engines = {mode: specdec.LLM(path, dtype=args.dtype, enable_prefix_caching=mode == "cache")
               for mode in ("no cache", "cache")}
    counters = {mode: count_computed(llm) for mode, llm in engines.items()}
    params = specdec.SamplingParams(temperature=0, max_tokens=1)
    for llm in engines.values():  # warm-up (a system prompt no repetition uses)
        llm.generate(prompt_token_ids=prompts(llm, "warm-up", 2), sampling_params=params)
    seq = {m: {"first_s": [], "later_s": [], "later_computed": [], "prompt_tokens": []} for m in engines}
    burst = {m: {"seconds": [], "computed": []} for m in engines}
    for rep in range(args.reps):
        for mode, llm in engines.items():
            ps = prompts(llm, f"sequential {rep}", args.requests)
            for i, p in enumerate(ps):
                before = counters[mode][0]
                seconds, out = timed(lambda llm=llm, p=p: llm.generate(prompt_token_ids=[p], sampling_params=params))
                assert counters[mode][0] - before == len(p) - out[0].metrics["num_cached_tokens"]
                if i == 0:
                    seq[mode]["first_s"].append(seconds)
                else:
                    seq[mode]["later_s"].append(seconds)
                    seq[mode]["later_computed"].append(counters[mode][0] - before)
                    seq[mode]["prompt_tokens"].append(len(p))
            ps = prompts(llm, f"burst {rep}", args.requests)
            before = counters[mode][0]
            seconds, _ = timed(lambda llm=llm, ps=ps: llm.generate(prompt_token_ids=ps, sampling_params=params))
            burst[mode]["seconds"].append(seconds)
            burst[mode]["computed"].append(counters[mode][0] - before)
    rows = []
    for mode in engines:
        s, b = seq[mode], burst[mode]
        rows.append([mode, median(s["prompt_tokens"]), median(s["later_computed"]), median(s["first_s"]) * 1e3,
                     median(s["later_s"]) * 1e3, median(b["computed"]), median(b["seconds"]) * 1e3])
    print(f"{args.model}, {args.dtype}, {args.threads} thread(s), {args.requests} requests per workload, "
          f"{args.reps} repetitions (medians)")
    print_table(rows, ["engine", "prompt tok", "computed (req 2+)", "req 1 ms", "req 2+ ms",
                       "burst computed", "burst ms"])
    stats = engines["cache"].engine.stats
    print(f"cache engine: {stats['prefix_cache_hits']} of {stats['prefix_cache_queries']} looked-up tokens served "
          f"from the cache")
    path = write_json("prefix_cache", {"args": vars(args), "machine": machine_info(), "sequential": seq,
                                       "burst": burst, "stats": stats}, args.record)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
