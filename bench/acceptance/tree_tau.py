"""Chains vs token trees: mean tokens per round (tau) at a known number of verified tokens per round.

    python -m bench.acceptance.tree_tau --target qwen-1.5b --draft qwen-0.5b --method draft_model --k 4 \
        --configs chain,block,tree:dynamic:4,tree:dynamic:8,tree:2,2,1,1 --temperature 0 0.8 --batch 1 8
    python -m bench.acceptance.tree_tau --target smollm2 --method prompt_lookup --k 8 \
        --configs chain,tree:dynamic:8,tree:dynamic:16 --temperature 0 0.8 --batch 1 8

Each configuration decodes the same prompts (the bench prompt classes, chat template applied) with the same
seeds. Reported per configuration: tau = emitted tokens / verification rounds, verified = target tokens per
round (drafted nodes + the root; a chain of k verifies k + 1), tau per verified token, and the acceptance rate.
tau does not depend on the machine's speed, so it is measured exactly on a shared CPU; the wall-clock column is
informative only (interleaving is by configuration, not by round). A configuration string is ``chain``
(token-wise verification), ``block`` (block verification of the chain, Sun et al. 2025), or ``tree:SHAPE[:BUDGET]``
with SHAPE ``dynamic`` or comma-separated branching factors.
"""

from __future__ import annotations

import argparse
import gc
import time

import specdec
from bench.common import (
    add_record_flag,
    chat_token_ids,
    load_prompts,
    machine_info,
    print_table,
    resolve_model,
    set_threads,
    warm_up_sampling,
    write_json,
)
from specdec.config import SPECULATIVE_METHODS, parse_tree
from specdec.tokenizer.tokenizer import Tokenizer

PROMPT_CLASSES = ["code", "copy", "json", "prose"]


def spec_config(text: str, method: str, draft: str | None, k: int) -> specdec.SpeculativeConfig:
    """``chain`` | ``block`` | ``tree:SHAPE[:BUDGET]`` -> the SpeculativeConfig it names."""
    kind, _, rest = text.partition(":")
    common = {"method": method, "draft_model": draft, "num_speculative_tokens": k}
    if kind == "chain":
        return specdec.SpeculativeConfig(**common)
    if kind == "block":
        return specdec.SpeculativeConfig(**common, verify="block")
    if kind == "tree":
        shape, _, budget = rest.partition(":") if rest.startswith("dynamic") else (rest, "", "")
        return specdec.SpeculativeConfig(**common, tree=parse_tree(shape), tree_budget=int(budget or 16))
    raise SystemExit(f"unknown configuration {text!r}: chain | block | tree:SHAPE[:BUDGET]")


def run(llm: specdec.LLM, prompts: list[list[int]], params: specdec.SamplingParams, batch: int) -> dict:
    """Decode ``prompts`` ``batch`` at a time; count rounds, emitted and verified tokens."""
    spec = llm.engine.speculative
    verified = {"rounds": 0, "tokens": 0}
    original = spec.draft

    def counting_draft(scheduled):
        drafts = original(scheduled)
        for seq in drafts.seqs:
            verified["rounds"] += 1
            verified["tokens"] += len(drafts.token_ids[seq.seq_id]) + 1
        return drafts

    spec.draft = counting_draft
    emitted_in_rounds = drafted = accepted = 0
    start = time.perf_counter()
    total = 0
    for i in range(0, len(prompts), batch):
        outs = llm.generate(prompt_token_ids=prompts[i : i + batch], sampling_params=params)
        for o in outs:
            m = o.metrics
            emitted_in_rounds += (m["mean_tokens_per_round"] or 0.0) * m["num_rounds"]
            drafted += m["drafted"]
            accepted += m["accepted"]
            total += len(o.outputs[0].token_ids)
    seconds = time.perf_counter() - start
    spec.draft = original
    rounds = verified["rounds"]
    tau = emitted_in_rounds / rounds if rounds else None
    per_round = verified["tokens"] / rounds if rounds else None
    return {"rounds": rounds, "tau": tau, "verified_per_round": per_round,
            "tau_per_verified": tau / per_round if rounds else None,
            "acceptance_rate": accepted / drafted if drafted else None, "tokens": total,
            "tokens_per_s": total / seconds}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.acceptance.tree_tau", description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", default="smollm2")
    parser.add_argument("--draft", default=None)
    parser.add_argument("--method", choices=SPECULATIVE_METHODS, required=True)
    parser.add_argument("--k", type=int, default=4, help="chain length; the depth cap of trees")
    parser.add_argument("--configs", default="chain,block,tree:dynamic:4")
    parser.add_argument("--temperature", type=float, nargs="+", default=[0.0, 0.8])
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--prompts-per-class", type=int, default=2)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    add_record_flag(parser)
    args = parser.parse_args(argv)
    set_threads(args.threads)
    warm_up_sampling()
    target, draft = resolve_model(args.target), resolve_model(args.draft) if args.draft else None
    tokenizer = Tokenizer.from_dir(target)
    prompts = [chat_token_ids(tokenizer, p.text) for ps in load_prompts(PROMPT_CLASSES, args.prompts_per_class).values()
               for p in ps]
    configs = args.configs.split(",") if "tree:" not in args.configs else _split_configs(args.configs)
    max_len = max(len(p) for p in prompts) + args.max_tokens + 64
    rows, results = [], []
    for text in configs:
        spec = spec_config(text, args.method, draft, args.k)
        lookahead = spec.tree_nodes(args.k)
        blocks = (max(args.batch) + 1) * (-(-(max_len + lookahead + 1) // 16)) + 2  # what this run needs
        llm = specdec.LLM(target, speculative=spec, dtype=args.dtype, max_model_len=max_len, seed=args.seed,
                          max_num_seqs=max(args.batch), num_kv_blocks=blocks)  # prefix cache: one prefill per prompt
        for temperature in args.temperature:
            params = specdec.SamplingParams(temperature=temperature, max_tokens=args.max_tokens, seed=args.seed,
                                            ignore_eos=True)
            for batch in args.batch:
                r = run(llm, prompts, params, batch) | {"config": text, "temperature": temperature, "batch": batch}
                results.append(r)
                rows.append([text, temperature, batch, r["rounds"], r["tau"], r["verified_per_round"],
                             r["tau_per_verified"], r["acceptance_rate"], r["tokens_per_s"]])
                print_table(rows[-1:], HEADER)
        del llm
        gc.collect()
    print()
    print_table(rows, HEADER)
    payload = {"machine": machine_info(), "args": vars(args), "results": results}
    path = write_json(f"tree_tau_{args.method}_{args.target}_k{args.k}", payload, args.record)
    print(f"wrote {path}")
    return 0


HEADER = ["config", "T", "batch", "rounds", "tau", "verified/round", "tau/verified", "acceptance", "tok/s (noisy)"]


def _split_configs(text: str) -> list[str]:
    """Split on commas that start a new configuration (tree shapes contain commas themselves)."""
    out: list[str] = []
    for part in text.split(","):
        if part.startswith(("chain", "block", "tree")) or not out:
            out.append(part)
        else:
            out[-1] += "," + part
    return out


if __name__ == "__main__":
    raise SystemExit(main())
