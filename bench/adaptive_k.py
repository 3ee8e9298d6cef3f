"""Adaptive k against plain decoding and every fixed k, per prompt class, in one process.

    python -m bench.adaptive_k --target qwen-1.5b --draft qwen-0.5b --k 4 [--method draft_model]
                               [--prompts code,json,copy,prose] [--prompts-per-class 1] [--max-tokens 64] [--reps 2]

Configurations: plain (``speculative=None``), fixed k = 1..K, adaptive (``adaptive=True``, k_max = K). Each run
of a configuration is its own process (a fresh engine - so adaptive starts cold, as a new server would - and one
copy of the weights in memory: a 1.5B fp32 target with its packed copy and a 0.5B draft take ~17 GB), which loads
the models, warms up with one short generation, then generates every class's prompts (chat template, batch 1,
greedy, ``ignore_eos``) and reports its wall time per class. Repetitions interleave the configurations in an order
that rotates by repetition. Reported per class: tokens/s of each (generated tokens / wall time of its ``generate``
calls, prefill included; median over repetitions), the best of plain and the fixed ks, and adaptive over that best
(the issue's target: >= 0.97 on every class); adaptive's ``k_per_step`` histogram; and a check that every
speculative configuration's tokens equal plain greedy decoding's (lossless; fp32).
Results: ``bench/out/adaptive_k_<target>_<draft>_k<K>_t<threads>.json`` (``--record``: ``bench/results/``).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

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
    set_threads,
    slug,
    timed,
    write_json,
)

CONFIGS_HELP = "plain, k=1..k=K, adaptive (and adaptive@old with --old-python)"


def config_names(k_max: int) -> list[str]:
    return ["plain", *(f"k={k}" for k in range(1, k_max + 1)), "adaptive"]


def run_one(args) -> dict:
    """In this process: build the configuration ``args.one``, warm it up, generate every class; per class the wall
    time, the tokens and the k granted per step."""
    target_path = resolve_model(args.target)
    draft_path = resolve_model(args.draft) if args.draft else None
    spec = None
    if args.one != "plain":
        adaptive = args.one == "adaptive"
        quant = {"draft_quantization": args.draft_quantization} if args.draft_quantization else {}
        spec = specdec.SpeculativeConfig(method=args.method, draft_model=draft_path, adaptive=adaptive,
                                         num_speculative_tokens=args.k if adaptive else int(args.one[2:]),
                                         prompt_lookup_min=args.prompt_lookup_min, **quant)
    quant = {"quantization": args.quantization} if args.quantization else {}  # (an older tree may not know it)
    llm = specdec.LLM(target_path, dtype=args.dtype, max_model_len=args.max_model_len,
                      num_kv_blocks=args.num_kv_blocks, speculative=spec, **quant)
    ids = class_ids(args, llm.engine.tokenizer)
    params = specdec.SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
    warm = next(iter(ids.values()))[:1]
    llm.generate(prompt_token_ids=warm, sampling_params=specdec.SamplingParams(temperature=0, max_tokens=8))
    reset = getattr(llm.engine.speculative, "reset_adaptive", None)  # (older trees have none: they stay warm)
    if args.one == "adaptive" and reset is not None:  # warm, but adaptive k starts cold: nothing from the warm-up
        reset()
    out = {}
    for cls, prompts in ids.items():
        cpu_start = time.process_time()
        seconds, outs = timed(lambda prompts=prompts: llm.generate(prompt_token_ids=prompts, sampling_params=params))
        cpu_seconds = time.process_time() - cpu_start
        out[cls] = {"seconds": seconds, "cpu_seconds": cpu_seconds, "tokens": [o.outputs[0].token_ids for o in outs],
                    "k_per_step": [k for o in outs for k in o.metrics["k_per_step"]],
                    "errors": [o.error for o in outs if o.error]}
    return out


def class_ids(args, tokenizer) -> dict[str, list[list[int]]]:
    return {cls: [chat_token_ids(tokenizer, p.text) for p in ps]
            for cls, ps in load_prompts(args.prompts.split(","), args.prompts_per_class).items()}


def tree_of(python: str) -> str:
    """The source tree ``python`` imports specdec from (its editable install): the children run there, so that
    ``-m bench.adaptive_k`` and ``specdec`` both come from that tree (the working directory is first on sys.path)."""
    code = "import os, specdec; print(os.path.dirname(os.path.dirname(os.path.abspath(specdec.__file__))))"
    return subprocess.run([python, "-c", code], capture_output=True, text=True, check=True,
                          cwd=tempfile.gettempdir()).stdout.strip()


def child_argv(argv: list[str]) -> list[str]:
    """The parent's arguments minus --old-python (an older tree's bench.adaptive_k does not know it)."""
    out, skip = [], False
    for a in argv:
        if skip:
            skip = False
        elif a == "--old-python":
            skip = True
        elif not a.startswith("--old-python="):
            out.append(a)
    return out


def measure(args, argv: list[str]) -> dict:
    """Every configuration once per repetition, each in its own process, in a rotating order."""
    names = args.configs.split(",") if args.configs else config_names(args.k)
    if args.old_python and "adaptive@old" not in names:
        names.append("adaptive@old")
    runs = {n: [] for n in names}
    trees = {args.python: tree_of(args.python), **({args.old_python: tree_of(args.old_python)}
                                                   if args.old_python else {})}
    with tempfile.TemporaryDirectory() as tmp:
        for rep in range(args.reps):
            order = names[rep % len(names):] + names[: rep % len(names)]
            for name in order:
                out = Path(tmp) / "one.json"
                python = args.old_python if name.endswith("@old") else args.python
                cmd = [python, "-m", "bench.adaptive_k", *child_argv(argv), "--one", name.removesuffix("@old"),
                       "--one-out", str(out)]
                subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, cwd=trees[python])
                runs[name].append(json.loads(out.read_text()))
                print(f"repetition {rep + 1}/{args.reps}: {name} done", flush=True)
    return {cls: {n: [r[cls] for r in rs] for n, rs in runs.items()} for cls in runs[names[0]][0]}


def summarize(runs: dict) -> dict:
    """Per class: tok/s by wall clock and by process CPU time (the same tokens over the median seconds of each
    clock: on a shared machine the CPU clock is the one another process's load does not move), the best of plain
    and the fixed k by each clock, adaptive over it, adaptive's k per step, and whether every run gave the same
    tokens."""
    out = {}
    for cls, by_name in runs.items():
        reference = next(iter(by_name.values()))[0]["tokens"]
        summary = {}
        for clock, key in (("wall", "seconds"), ("cpu", "cpu_seconds")):
            rates = {n: sum(len(t) for t in r[0]["tokens"]) / median([x.get(key, x["seconds"]) for x in r])
                     for n, r in by_name.items()}
            others = [n for n in rates if not n.startswith("adaptive")]
            best_name = max(others, key=rates.get) if others else None
            suffix = "" if clock == "wall" else "_cpu"
            summary.update({f"tok_s{suffix}": rates, f"best_fixed_or_plain{suffix}": best_name,
                            f"adaptive_over_best{suffix}": rates["adaptive"] / rates[best_name]
                            if best_name and "adaptive" in rates else None})
        out[cls] = {
            **summary,
            "adaptive_k_per_step": dict(sorted(Counter(k for r in by_name.get("adaptive", [])
                                                       for k in r["k_per_step"]).items())),
            "lossless": all(r["tokens"] == reference for n, rs in by_name.items() for r in rs),
            "errors": [e for rs in by_name.values() for r in rs for e in r["errors"]],
        }
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.adaptive_k", description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", default="qwen-1.5b")
    parser.add_argument("--draft", default="qwen-0.5b", help="draft model (draft_model / combined); '' for none")
    parser.add_argument("--method", default="draft_model", choices=specdec.config.SPECULATIVE_METHODS)
    parser.add_argument("--k", type=int, default=4, help="the largest fixed k, and adaptive's k_max")
    parser.add_argument("--prompts", default=",".join(PROMPT_CLASSES))
    parser.add_argument("--prompts-per-class", type=int, default=1)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--reps", type=int, default=2)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--max-model-len", type=int, default=2048)
    parser.add_argument("--num-kv-blocks", type=int, default=512)
    parser.add_argument("--prompt-lookup-min", type=int, default=2)
    parser.add_argument("--quantization", choices=("int8", "int4"), default=None, help="LLM(quantization=)")
    parser.add_argument("--draft-quantization", choices=("int8", "int4"), default=None,
                        help="SpeculativeConfig(draft_quantization=)")
    parser.add_argument("--configs", default=None, help=f"comma-separated subset of: {CONFIGS_HELP} (default: all)")
    parser.add_argument("--python", default=sys.executable,
                        help="the interpreter that runs each configuration (another tree's venv: old vs new)")
    parser.add_argument("--old-python", default=None,
                        help="also run adaptive with this interpreter (the previous commit's tree), as 'adaptive@old'")
    parser.add_argument("--one", default=None, help=f"internal: run one configuration ({CONFIGS_HELP}) here")
    parser.add_argument("--one-out", default=None, help="internal: where --one writes its JSON")
    add_record_flag(parser)
    argv = sys.argv[1:] if argv is None else argv
    args = parser.parse_args(argv)
    set_threads(args.threads)
    if args.one is not None:
        Path(args.one_out).write_text(json.dumps(run_one(args)))
        return 0
    summary = summarize(measure(args, argv))
    names = list(next(iter(summary.values()))["tok_s"])
    print(f"\n{args.target} / {args.draft or args.method}, greedy, {args.dtype}, {torch.get_num_threads()} thread(s), "
          f"{args.max_tokens} tokens, median of {args.reps}")
    for clock, suffix in (("wall clock", ""), ("process CPU time", "_cpu")):
        rows = [[cls, *(s[f"tok_s{suffix}"][n] for n in names), s[f"best_fixed_or_plain{suffix}"],
                 s[f"adaptive_over_best{suffix}"], s["adaptive_k_per_step"], s["lossless"]]
                for cls, s in summary.items()]
        print(f"tok/s by {clock}")
        print_table(rows, ["class", *(f"{n} tok/s" for n in names), "best", "adaptive / best", "adaptive k_per_step",
                           "lossless"])
    payload = {"machine": machine_info(), "args": vars(args), "summary": summary}
    name = (f"adaptive_k_{slug(args.target)}_{slug(args.draft or args.method)}_k{args.k}_t{args.threads}_{args.dtype}"
            f"{'_' + args.quantization if args.quantization else ''}"
            f"{'_d' + args.draft_quantization if args.draft_quantization else ''}")
    print(f"wrote {write_json(name, payload, args.record)}")
    failed = [cls for cls, s in summary.items() if s["errors"] or not s["lossless"]]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
