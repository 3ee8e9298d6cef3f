"""Model-free token trees vs chains: tokens per round under greedy verification, replayed on recorded outputs.

The target's greedy output of each bench prompt is generated once (target only, fp32, cached in ``bench/out``)
and then replayed: each round the drafter proposes from the text so far, greedy verification accepts the drafts
the output actually continues with (for a tree: from the root, follow the child equal to the next output token)
plus the target's own next token, and the round advances by that many tokens. That is exactly what greedy
speculative decoding does with these drafts, without running the model again, so chains and trees of any shape
are compared on the same outputs. A round with no draft is a plain decode step (1 token).

Reported per drafter configuration and prompt class: tau (tokens per round, all rounds), the mean drafted
(verified) nodes per round that drafted, and the drafter's own CPU time per call.

    python -m bench.acceptance.tree_lookup                              # SmolLM2, 4 classes x 4 prompts, 128 tokens
    python -m bench.acceptance.tree_lookup --max-tokens 64 --prompts-per-class 2 --prompt-lookup-min 1
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import dataclass

import specdec
from bench.common import (
    OUT_DIR,
    PROMPT_CLASSES,
    RESULTS_DIR,
    chat_token_ids,
    load_prompts,
    machine_info,
    resolve_model,
    set_threads,
)
from specdec.engine.sequence import Sequence
from specdec.sampling.params import SamplingParams
from specdec.spec_decode.proposers.ngram_table import NgramTableProposer
from specdec.spec_decode.proposers.prompt_lookup import PromptLookupProposer
from specdec.spec_decode.tree import DraftTree
from specdec.tokenizer.tokenizer import Tokenizer


@dataclass(frozen=True)
class Config:
    name: str
    method: str  # prompt_lookup | ngram
    depth: int  # chain: k
    nodes: int | None  # None: a chain of ``depth`` drafts (propose); else a tree of at most this many (propose_tree)
    keep_chain: bool = True  # trees: propose()'s chain kept first (the drafters' default) or best-first only


METHODS = ("prompt_lookup", "ngram_table")
CONFIGS = [Config(f"{m} chain k={k}", m, k, None) for m in METHODS for k in (4, 8, 16)] + [
    Config(f"{m} tree d={d} n={n}", m, d, n) for m in METHODS for d, n in ((4, 4), (4, 8), (8, 8), (8, 16), (16, 16))
] + [Config(f"{m} tree d={d} n={n} no chain", m, d, n, False) for m in METHODS for d, n in ((8, 8), (16, 16))]


def greedy_accepted(tree: DraftTree, target: list[int]) -> int:
    """Drafts greedy tree verification accepts when the target continues with ``target``."""
    kids, node, n = tree.children(), 0, 0
    while n < len(target):
        node = next((c for c in kids[node] if tree.token_ids[c] == target[n]), None)
        if node is None:
            break
        n += 1
    return n


def replay(config: Config, prompt: list[int], output: list[int], lookup_min: int = 2) -> dict:
    """One request replayed round by round (see the module docstring)."""
    if config.method == "prompt_lookup":
        drafter = PromptLookupProposer(lookup_min, max(lookup_min, 4), keep_chain=config.keep_chain)
    else:
        drafter = NgramTableProposer(keep_chain=config.keep_chain)
    seq = Sequence(0, "replay", None, list(prompt), SamplingParams(), 0, frozenset())
    done = rounds = drafting_rounds = drafted = 0
    seconds = 0.0
    while done < len(output):
        for token in output[len(seq.output_token_ids) : done]:
            seq.append_token(token)
        start = time.perf_counter()
        if config.nodes is None:
            drafts = drafter.propose([seq], [config.depth]).token_ids[0]
            tree = DraftTree.chain(seq.last_token_id, drafts)
        else:
            tree = drafter.propose_tree([seq], [config.depth], [config.nodes]).trees[0]
        seconds += time.perf_counter() - start
        accepted = greedy_accepted(tree, output[done:])
        done += min(accepted + 1, len(output) - done)  # accepted drafts + the target's token (cut at the end)
        rounds += 1
        drafting_rounds += tree.num_drafts > 0
        drafted += tree.num_drafts
    return {"tokens": len(output), "rounds": rounds, "drafting_rounds": drafting_rounds, "drafted": drafted,
            "seconds": seconds}


def summarise(rows: list[dict]) -> dict:
    tokens, rounds = sum(r["tokens"] for r in rows), sum(r["rounds"] for r in rows)
    drafting = sum(r["drafting_rounds"] for r in rows)
    return {"tau": tokens / rounds, "drafted_per_drafting_round": sum(r["drafted"] for r in rows) / max(drafting, 1),
            "drafting_round_fraction": drafting / rounds, "us_per_call": 1e6 * sum(r["seconds"] for r in rows) / rounds}


def greedy_outputs(target: str, classes: list[str], per_class: int | None, max_tokens: int) -> dict:
    """{class: [(prompt ids, greedy output ids)]}, generated once and cached under bench/out."""
    key = f"{target.replace('/', '_')}_{'-'.join(classes)}_{per_class}_{max_tokens}"
    cache = OUT_DIR / f"tree_lookup_streams_{key}.json"
    if cache.is_file():
        return json.loads(cache.read_text())
    path = resolve_model(target)
    tokenizer = Tokenizer.from_dir(path)
    prompts = load_prompts(classes, per_class)
    ids = {cls: [chat_token_ids(tokenizer, p.text) for p in ps] for cls, ps in prompts.items()}
    llm = specdec.LLM(path, dtype="float32")
    params = specdec.SamplingParams(temperature=0, max_tokens=max_tokens)
    streams = {}
    for cls, prompt_ids in ids.items():
        outs = llm.generate(prompt_token_ids=prompt_ids, sampling_params=params)
        streams[cls] = [(p, o.outputs[0].token_ids) for p, o in zip(prompt_ids, outs)]
    OUT_DIR.mkdir(exist_ok=True)
    cache.write_text(json.dumps(streams))
    return streams


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", default="smollm2", help="folder, or smollm2 | qwen-0.5b | qwen-1.5b")
    parser.add_argument("--prompts", default=",".join(PROMPT_CLASSES), help="comma-separated prompt classes")
    parser.add_argument("--prompts-per-class", type=int, default=None)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--prompt-lookup-min", type=int, default=2, help="shortest suffix prompt lookup matches")
    parser.add_argument("--record", action="store_true", help="write to bench/results (else bench/out)")
    args = parser.parse_args(argv)
    set_threads(args.threads)
    classes = args.prompts.split(",")
    streams = greedy_outputs(args.target, classes, args.prompts_per_class, args.max_tokens)

    command = " ".join(["python -m bench.acceptance.tree_lookup", *(sys.argv[1:] if argv is None else argv)])
    results = {"meta": {**machine_info(), "command": command,
                        "target": args.target, "max_tokens": args.max_tokens,
                        "prompt_lookup_min": args.prompt_lookup_min,
                        "prompts": {cls: len(v) for cls, v in streams.items()}}, "configs": {}}
    header = f"{'drafter':<37}" + "".join(f"{cls:>8}" for cls in classes) + f"{'all':>8}{'drafts':>8}{'us/call':>9}"
    print("tau (tokens per round) under greedy verification of the recorded outputs")
    print(header)
    for config in CONFIGS:
        per_class = {cls: [replay(config, p, o, args.prompt_lookup_min) for p, o in streams[cls]] for cls in classes}
        everything = summarise([r for rows in per_class.values() for r in rows])
        row = {cls: summarise(rows) for cls, rows in per_class.items()} | {"all": everything}
        results["configs"][config.name] = row
        print(f"{config.name:<37}" + "".join(f"{row[cls]['tau']:>8.3f}" for cls in classes)
              + f"{everything['tau']:>8.3f}{everything['drafted_per_drafting_round']:>8.2f}"
              + f"{everything['us_per_call']:>9.1f}")
    folder = RESULTS_DIR if args.record else OUT_DIR
    folder.mkdir(exist_ok=True)
    out = folder / f"tree_lookup_{args.target.replace('/', '_')}_{args.max_tokens}_min{args.prompt_lookup_min}.json"
    out.write_text(json.dumps(results, indent=1))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
