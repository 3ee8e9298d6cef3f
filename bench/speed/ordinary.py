"""Model-free drafters on ordinary prompts (issue 34): the six kinds, or the repetitive workload, interleaved.

    python -m bench.speed.ordinary [--workload kinds|repetitive] [--target smollm2] [--dtype float32]
        [--quantization int4] [--configs plain,prompt_lookup_k4,prompt_lookup_k8,ngram_table,recycle]
        [--max-tokens 128] [--threads 1] [--record]

``kinds``: the chat prompts of ``bench/prompts/{conversation,translation,summarisation,qa,maths,retrieval}/`` (4
per kind). ``repetitive``: ``bench/prompts/repetitive/workload.json``, 32 requests over 8 shared documents, sent
one after another. Every configuration is its own engine (the target's weights shared: one copy), kept for the
whole run, so a drafter that learns across requests (``recycle``'s engine-wide matrix, ``suffix``'s index of
earlier outputs) carries what it learnt from
one request to the next, as a server would; each request is run **once** per engine (a repetition would let such
a drafter see the same request twice). Per request the engines run one after another in an order that rotates
with the request index. Greedy, batch 1, chat template, stopping at EOS (``--max-tokens`` at most); prefix caching
on for the repetitive workload (its requests share documents, as a server's would), off for the kinds.

Reported per kind (or per task of the workload) and configuration: tok/s (generated tokens / seconds of
``generate``, prefill included), the speedup over plain, tau (tokens per verification round, bonus included),
acceptance per drafted token, and whether the tokens equal plain decoding's; then the geometric mean of the
speedups over the kinds. Results: ``bench/out/ordinary_<workload>_<target>_<dtype>[_<quant>]_t<threads>.json``
(``--record``: ``bench/results/``).
"""

from __future__ import annotations

import argparse
import json
import math
import time

import torch

import specdec
from bench.common import (
    PROMPTS_DIR,
    add_record_flag,
    chat_token_ids,
    load_prompts,
    machine_info,
    print_table,
    resolve_model,
    set_threads,
    slug,
    write_json,
)
from bench.speed.e2e import aggregate_metrics, reuse_target_weights

KINDS = ("conversation", "translation", "summarisation", "qa", "maths", "retrieval")
# name -> SpeculativeConfig kwargs (None: plain decoding)
CONFIGS = {
    "plain": None,
    "prompt_lookup_k4": dict(method="prompt_lookup", num_speculative_tokens=4),
    "prompt_lookup_k8": dict(method="prompt_lookup", num_speculative_tokens=8),
    "ngram_table": dict(method="ngram_table", num_speculative_tokens=4),
    "recycle": dict(method="recycle", num_speculative_tokens=5),
    "recycle_always": dict(method="recycle", num_speculative_tokens=5, tree_policy="always"),
    "recycle_b8": dict(method="recycle", num_speculative_tokens=4, tree_budget=8),
    "suffix": dict(method="suffix", num_speculative_tokens=8),
    "suffix_k16": dict(method="suffix", num_speculative_tokens=16),
    "suffix_tree": dict(method="suffix", num_speculative_tokens=8, tree="dynamic"),
    "pick": dict(method="pick", num_speculative_tokens=6),
    "pick_k8": dict(method="pick", num_speculative_tokens=8),
    "pick_tree": dict(method="pick", num_speculative_tokens=6, tree="dynamic"),
}


def workload_requests(workload: str, tokenizer) -> list[tuple[str, list[int]]]:
    """(group, prompt ids) per request, in the order sent: the kinds' prompts kind by kind, or the repetitive
    workload's 32 requests (group = its task)."""
    if workload == "kinds":
        prompts = load_prompts(list(KINDS))
        return [(kind, chat_token_ids(tokenizer, p.text)) for kind, ps in prompts.items() for p in ps]
    folder = PROMPTS_DIR / "repetitive"
    spec = json.loads((folder / "workload.json").read_text())
    out = []
    for r in spec["requests"]:
        doc = (folder / "documents" / r["document"]).read_text()
        text = f"```\n{doc}```\n\n{r['ask']}"
        out.append((r["task"], chat_token_ids(tokenizer, text)))
    return out


def run(engines: dict[str, specdec.LLM], requests: list[tuple[str, list[int]]], params) -> dict:
    """Every engine on every request once, the order rotating per request: per engine, per request, the seconds,
    the tokens and the metrics."""
    names = list(engines)
    runs = {n: [] for n in names}
    for i, (group, prompt) in enumerate(requests):
        for name in names[i % len(names):] + names[: i % len(names)]:
            start = time.perf_counter()
            out = engines[name].generate(prompt_token_ids=[prompt], sampling_params=params)[0]
            seconds = time.perf_counter() - start
            if out.error:
                raise RuntimeError(f"{name}: request {i} failed: {out.error}")
            runs[name].append({"group": group, "seconds": seconds, "tokens": out.outputs[0].token_ids,
                               "metrics": out.metrics})
        print(f"  request {i + 1}/{len(requests)} ({group}) done", flush=True)
    return runs


def summarize(runs: dict, groups: list[str]) -> dict:
    """Per group and engine: tok/s, speedup over plain, tau, acceptance, lossless; plus "all" (every request)."""
    out = {}
    for group in [*groups, "all"]:
        rows = {}
        for name, reqs in runs.items():
            mine = [r for r in reqs if group in ("all", r["group"])]
            tokens, seconds = sum(len(r["tokens"]) for r in mine), sum(r["seconds"] for r in mine)
            row = {"tokens": tokens, "seconds": seconds, "tok_s": tokens / seconds}
            if name != "plain":
                m = aggregate_metrics([r["metrics"] for r in mine])
                plain = [r["tokens"] for r in runs["plain"] if group in ("all", r["group"])]
                row.update(tau=m["tau"], acceptance=m["acceptance_rate"],
                           speculating_step_fraction=m["speculating_step_fraction"],
                           lossless=[r["tokens"] for r in mine] == plain)
            rows[name] = row
        for row in rows.values():
            row["speedup"] = row["tok_s"] / rows["plain"]["tok_s"]
        out[group] = rows
    return out


def geomean(xs: list[float]) -> float:
    return math.exp(sum(math.log(x) for x in xs) / len(xs))


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(prog="python -m bench.speed.ordinary", description=__doc__.split("\n\n")[0])
    parser.add_argument("--workload", choices=("kinds", "repetitive"), default="kinds")
    parser.add_argument("--target", default="smollm2", help="folder, or smollm2 | qwen-0.5b | qwen-1.5b")
    parser.add_argument("--configs", default="plain,prompt_lookup_k4,prompt_lookup_k8,ngram_table,recycle",
                        help=f"comma-separated, of: {', '.join(CONFIGS)} (plain is always run)")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--quantization", choices=("int8", "int4"), default=None)
    add_record_flag(parser)
    args = parser.parse_args(argv)
    names = ["plain"] + [n for n in args.configs.split(",") if n and n != "plain"]
    unknown = [n for n in names if n not in CONFIGS]
    if unknown:
        parser.error(f"unknown configs {unknown}; known: {', '.join(CONFIGS)}")
    set_threads(args.threads)
    meta = machine_info()
    print(f"{meta['machine']}, torch {meta['torch']}, {torch.get_num_threads()} thread(s), "
          f"load {meta['load_average_at_start'][0]:.1f}", flush=True)

    target = resolve_model(args.target)
    # the repetitive workload's requests share documents: prefix caching on, as a server runs (every engine has its
    # own cache, plain included), so the shared prompts' prefill does not hide the decoding
    kwargs = {"dtype": args.dtype, "max_model_len": 4096, "num_kv_blocks": 1024,
              "enable_prefix_caching": args.workload == "repetitive", "quantization": args.quantization}
    plain = specdec.LLM(target, **kwargs)
    engines = {"plain": plain}
    with reuse_target_weights(plain):
        for name in names[1:]:
            engines[name] = specdec.LLM(target, speculative=specdec.SpeculativeConfig(**CONFIGS[name]), **kwargs)
    tokenizer = plain.engine.tokenizer
    warm = chat_token_ids(tokenizer, "Hello!")
    for llm in engines.values():
        llm.generate(prompt_token_ids=[warm], sampling_params=specdec.SamplingParams(temperature=0, max_tokens=8))
    requests = workload_requests(args.workload, tokenizer)
    groups = list(dict.fromkeys(g for g, _ in requests))
    print(f"{args.workload}: {len(requests)} requests x {len(engines)} engines", flush=True)
    params = specdec.SamplingParams(temperature=0, max_tokens=args.max_tokens)
    runs = run(engines, requests, params)
    results = summarize(runs, groups)
    geo = {name: geomean([results[g][name]["speedup"] for g in groups]) for name in engines}

    rows = [[g, name, row["tok_s"], row["speedup"], row.get("tau"), row.get("acceptance"), row.get("lossless", "-")]
            for g, by_name in results.items() for name, row in by_name.items()]
    print(f"\n{args.target}, {args.dtype}{' ' + args.quantization if args.quantization else ''}, greedy, batch 1, "
          f"<= {args.max_tokens} tokens, stopping at EOS, {args.threads} thread(s)")
    print_table(rows, ["group", "config", "tok/s", "speedup", "tau", "accept", "lossless"])
    print("geometric mean of the speedups over the groups: " + ", ".join(f"{n} {v:.3f}" for n, v in geo.items()))
    quant = f"_{args.quantization}" if args.quantization else ""
    name = f"ordinary_{args.workload}_{slug(args.target)}_{args.dtype}{quant}_t{args.threads}"
    per_request = {n: [{k: r[k] for k in ("group", "seconds")} | {"num_tokens": len(r["tokens"])} for r in reqs]
                   for n, reqs in runs.items()}
    payload = {"machine": meta, "args": vars(args), "configs": {n: CONFIGS[n] for n in names}, "results": results,
               "geomean_speedup": geo, "per_request": per_request}
    print(f"wrote {write_json(name, payload, args.record)}")
    return payload


if __name__ == "__main__":
    main()
