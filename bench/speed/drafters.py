"""Drafters side by side on one target: plain decoding and every drafter named, in one process, interleaved.

    python -m bench.speed.drafters --target qwen-1.5b \\
        --drafters draft_model:qwen-0.5b,prompt_lookup,eagle3:/work/heads/qwen-eagle3 [--k 4] [--reps 3] \\
        [--prompts code,json,copy,prose] [--prompts-per-class 1] [--max-tokens 64] [--dtype float32] [--clock cpu]

A drafter is ``METHOD`` (``prompt_lookup``, ``ngram_table``) or ``METHOD:MODEL`` (``draft_model:qwen-0.5b``,
``eagle3:HEAD_FOLDER``, ``combined:MODEL``, ``draft_model:self``); a draft model's name may end in ``+vocab``
(``draft_model:self+vocab``): the same draft with its LM head cut to ``--draft-vocab`` (``--draft-vocab-size``),
so the full and the reduced draft vocabulary run side by side. Each drafts a chain of ``--k`` tokens (fixed k: the
drafters are compared, not the policy that picks k). Every engine shares the plain engine's target weights (one copy
in memory) and has its own KV pool. Per prompt and repetition, plain and every drafter generate it once (batch 1, chat
template, greedy, ``ignore_eos``), in an order that rotates by repetition.

Reported per class and drafter: tok/s (generated tokens / the median over repetitions of the ``generate`` time,
prefill included; ``--clock cpu``: process CPU time, which other processes' load does not move), the speedup over
plain, tau (tokens per verification round, the bonus token included), the acceptance per drafted token, c (one draft
step over one target decode at batch 1, timed on the engines' own models: ``bench.speed.e2e.measure_costs``), and
whether the tokens equal plain greedy decoding's (lossless: expected in float32). Results:
``bench/out/drafters_<target>_k<K>_t<threads>.json`` (``--record``: ``bench/results/``).
"""

from __future__ import annotations

import argparse
import time

import torch

import specdec
from bench.common import (
    PROMPT_CLASSES,
    add_record_flag,
    chat_token_ids,
    load_prompts,
    machine_info,
    median,
    print_table,
    resolve_model,
    set_clock,
    set_threads,
    slug,
    timed,
    write_json,
)
from bench.speed.e2e import aggregate_metrics, draft_step_model, measure_costs, reuse_target_weights

MODEL_METHODS = ("draft_model", "eagle3", "combined")  # the methods whose drafter names a model


def parse_drafter(spec: str) -> tuple[str, str | None, bool]:
    """``"METHOD"``, ``"METHOD:MODEL"`` or ``"METHOD:MODEL+vocab"`` -> (method, model path or None, whether the
    reduced draft vocabulary applies); a clear error for anything else."""
    reduced = spec.endswith("+vocab")
    method, _, model = spec.removesuffix("+vocab").partition(":")
    if reduced and method not in ("draft_model", "combined"):
        raise ValueError(f"drafter {spec!r}: +vocab (a reduced draft vocabulary) is for draft_model / combined")
    if method not in specdec.config.SPECULATIVE_METHODS:
        raise ValueError(f"drafter {spec!r}: unknown method {method!r}; allowed: "
                         f"{', '.join(specdec.config.SPECULATIVE_METHODS)}")
    if method in MODEL_METHODS and not model:
        raise ValueError(f"drafter {spec!r}: {method} needs a model, as {method}:MODEL")
    if model and method not in MODEL_METHODS:
        raise ValueError(f"drafter {spec!r}: {method} takes no model")
    return method, (resolve_model(model) if model else None), reduced


def select_prompts(prompts: dict[str, list], names: str | None) -> dict[str, list]:
    """``prompts`` (class -> prompts) kept to the file stems in the comma-separated ``names`` (all when None);
    classes left with none are dropped."""
    if not names:
        return prompts
    keep = set(names.split(","))
    kept = {cls: [p for p in ps if p.name in keep] for cls, ps in prompts.items()}
    return {cls: ps for cls, ps in kept.items() if ps}


def run_class(engines: dict[str, specdec.LLM], prompts: list[list[int]], params, reps: int) -> dict:
    """Every engine on every prompt ``reps`` times, the order rotating per repetition; per engine the generated
    tokens, the seconds of each repetition by the chosen clock and by process CPU time (summed over the prompts)
    and the requests' metrics (of the first repetition: greedy, so every repetition's are the same)."""
    names = list(engines)
    runs = {n: {"seconds": [0.0] * reps, "cpu_seconds": [0.0] * reps, "tokens": [], "metrics": []} for n in names}
    for prompt in prompts:
        for rep in range(reps):
            for name in names[rep % len(names):] + names[: rep % len(names)]:
                cpu_start = time.process_time()
                seconds, outs = timed(lambda name=name, prompt=prompt: engines[name].generate(
                    prompt_token_ids=[prompt], sampling_params=params))
                runs[name]["seconds"][rep] += seconds
                runs[name]["cpu_seconds"][rep] += time.process_time() - cpu_start
                if rep == 0:
                    runs[name]["tokens"].append(outs[0].outputs[0].token_ids)
                    runs[name]["metrics"].append(outs[0].metrics)
                if outs[0].error:
                    raise RuntimeError(f"{name}: request failed: {outs[0].error}")
    return runs


def summarize(runs: dict, costs: dict) -> dict:
    """Per engine: tok/s by the chosen clock and by CPU time, speedup over plain, tau, acceptance, c, lossless."""
    plain_tokens = runs["plain"]["tokens"]
    out = {}
    for name, r in runs.items():
        tokens = sum(len(t) for t in r["tokens"])
        tok_s, tok_s_cpu = tokens / median(r["seconds"]), tokens / median(r["cpu_seconds"])
        row = {"tok_s": tok_s, "tok_s_cpu": tok_s_cpu, "seconds": r["seconds"], "cpu_seconds": r["cpu_seconds"]}
        if name != "plain":
            m = aggregate_metrics(r["metrics"])
            row.update(tau=m["tau"], acceptance=m["acceptance_rate"], c=costs[name]["c"],
                       draft_1_ms=costs[name]["draft_1_ms"], target_1_ms=costs[name]["target_1_ms"],
                       lossless=r["tokens"] == plain_tokens)
        out[name] = row
    for row in out.values():
        row["speedup"] = row["tok_s"] / out["plain"]["tok_s"]
        row["speedup_cpu"] = row["tok_s_cpu"] / out["plain"]["tok_s_cpu"]
    return out


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(prog="python -m bench.speed.drafters", description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", default="smollm2", help="folder, or smollm2 | qwen-0.5b | qwen-1.5b")
    parser.add_argument("--drafters", required=True,
                        help="comma-separated METHOD or METHOD:MODEL, e.g. draft_model:qwen-0.5b,prompt_lookup")
    parser.add_argument("--k", type=int, default=4, help="drafted tokens per round (a chain)")
    parser.add_argument("--prompts", default=",".join(PROMPT_CLASSES), help="comma-separated prompt classes")
    parser.add_argument("--prompts-per-class", type=int, default=1)
    parser.add_argument("--prompt-names", default=None,
                        help="comma-separated prompt file stems to keep (e.g. 03_letter), after --prompts-per-class")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--clock", choices=("wall", "cpu"), default="wall")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--quantization", choices=("int8", "int4"), default=None)
    parser.add_argument("--draft-quantization", choices=("int8", "int4"), default=None)
    parser.add_argument("--draft-vocab", default=None, help="the draft-vocabulary file of the +vocab drafters "
                        "(`specdec draft-vocab`)")
    parser.add_argument("--draft-vocab-size", type=int, default=None, help="keep its first N ids")
    add_record_flag(parser)
    args = parser.parse_args(argv)
    if args.k < 1 or args.reps < 1 or args.max_tokens < 1:
        parser.error("--k, --reps and --max-tokens must be >= 1")
    try:
        drafters = {spec: parse_drafter(spec) for spec in args.drafters.split(",") if spec}
    except ValueError as e:
        parser.error(str(e))
    if not drafters:
        parser.error("--drafters names no drafter")
    if any(reduced for _, _, reduced in drafters.values()) and args.draft_vocab is None:
        parser.error("a +vocab drafter needs --draft-vocab")
    set_threads(args.threads)
    set_clock(args.clock)
    meta = {**machine_info(), "clock": args.clock}
    print(f"{meta['machine']}, torch {meta['torch']}, {torch.get_num_threads()} thread(s), "
          f"load {meta['load_average_at_start'][0]:.1f}", flush=True)

    target_path = resolve_model(args.target)
    engine_kwargs = {"dtype": args.dtype, "max_model_len": 2048, "num_kv_blocks": 256,
                     "enable_prefix_caching": False, "quantization": args.quantization}
    plain = specdec.LLM(target_path, **engine_kwargs)
    engines: dict[str, specdec.LLM] = {"plain": plain}
    with reuse_target_weights(plain):  # one copy of the target's weights for every engine
        for name, (method, model, reduced) in drafters.items():
            spec = specdec.SpeculativeConfig(method=method, draft_model=model, num_speculative_tokens=args.k,
                                             draft_quantization=args.draft_quantization
                                             if method in ("draft_model", "combined") else None,
                                             draft_vocab=args.draft_vocab if reduced else None,
                                             draft_vocab_size=args.draft_vocab_size if reduced else None)
            engines[name] = specdec.LLM(target_path, speculative=spec, **engine_kwargs)
    tokenizer = plain.engine.tokenizer
    prompts = select_prompts(load_prompts(args.prompts.split(","), args.prompts_per_class), args.prompt_names)
    if not prompts:
        parser.error(f"--prompt-names {args.prompt_names}: no prompt of the classes {args.prompts} has that name")
    ids = {cls: [chat_token_ids(tokenizer, p.text) for p in ps] for cls, ps in prompts.items()}
    warm = specdec.SamplingParams(temperature=0, max_tokens=8)
    for llm in engines.values():
        llm.generate(prompt_token_ids=next(iter(ids.values()))[:1], sampling_params=warm)
    params = specdec.SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)

    target_model, config = plain.engine.model, plain.engine.model_config
    results: dict = {}
    for cls, prompts in ids.items():
        print(f"{cls}: {len(prompts)} prompt(s) x {args.reps} repetition(s) x {len(engines)} engines", flush=True)
        runs = run_class(engines, prompts, params, args.reps)
        context = round(sum(len(p) for p in prompts) / len(prompts) + args.max_tokens / 2)
        costs = {}
        for name in drafters:
            draft_model, draft_config, head = draft_step_model(engines[name])
            costs[name] = measure_costs(target_model, draft_model, config, draft_config, 1, context, args.k,
                                        eagle3_head=head)
        results[cls] = summarize(runs, costs)

    header = ["class", "drafter", "tok/s", "speedup", "tau", "accept", "c", "lossless"]
    def fmt(value, spec: str) -> str:
        return "-" if value is None else format(value, spec)

    rows = [[cls, name, fmt(row["tok_s"], ".3g"), fmt(row["speedup"], ".3f"), fmt(row.get("tau"), ".2f"),
             fmt(row.get("acceptance"), ".3f"), fmt(row.get("c"), ".3f"), row.get("lossless", "-")]
            for cls, by_name in results.items() for name, row in by_name.items()]
    print(f"\n{args.target}, k={args.k}, greedy, {args.dtype}, batch 1, {args.max_tokens} tokens, median of "
          f"{args.reps}; tok/s by {args.clock} clock")
    print_table(rows, header)
    name = f"drafters_{slug(args.target)}_k{args.k}_t{args.threads}"
    payload = {"machine": meta, "args": vars(args), "results": results}
    print(f"wrote {write_json(name, payload, args.record)}")
    return payload


if __name__ == "__main__":
    main()
