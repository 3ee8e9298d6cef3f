"""Expected accepted drafts per round, block vs token-wise verification, exactly, on real model distributions.

    python -m bench.acceptance.block_verify --target qwen-1.5b --draft qwen-0.5b --k 4 --temperature 0.8

The speculative engine runs with token-wise verification on the bench prompts. For every sampled verification
round it is handed the drafted block x and the standardized target p and draft q at every draft position (the
inputs of ``ops.spec_sample``), and computes in float64 the EXACT expected number of accepted drafts given x under
both rules:

    token:  sum_i prod_{j <= i} min(1, p_j(x_j) / q_j(x_j))
    block:  sum_i i * Pr(tau = i | x), from the carried weights w_i, the residual masses r_i and the stop
            probabilities h_i = r_i / (r_i + 1 - w_i) (``block_weights`` / ``residual_mass`` of
            kernels/block_verify.py, the reference's own steps)

x ~ q under both rules, so each mean over rounds estimates that rule's expected accepted drafts per round, and
both are computed on the same blocks and contexts: the paired difference has a much smaller error than two
sampled runs would (its standard error is printed). Tokens per round = accepted + 1. The contexts are those of
the token-wise run (the text it sampled). The sampled accepted count of that run is printed beside its exact
expectation as a check.
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from pathlib import Path

import torch

import specdec
from bench.common import (
    PROMPT_CLASSES,
    add_record_flag,
    chat_token_ids,
    load_prompts,
    machine_info,
    resolve_model,
    set_threads,
    slug,
    warm_up_sampling,
    write_json,
)
from specdec import ops
from specdec.kernels.block_verify import block_weights, residual_mass
from specdec.tokenizer.tokenizer import Tokenizer


def expected_accepted(p_rows: torch.Tensor, q_rows: torch.Tensor, drafts: torch.Tensor) -> tuple[float, float]:
    """(token-wise, block) expected accepted drafts of one block, float64.

    Args:
        p_rows: ``[k + 1, V]`` target p at the draft positions and the bonus position.
        q_rows: ``[k, V]`` draft q at the draft positions.
        drafts: int64 ``[k]``.
    """
    k = drafts.shape[0]
    p, q = p_rows.double(), q_rows.double()
    idx = torch.arange(k)
    p_x, q_x = p[idx, drafts], q[idx, drafts]  # (k,)
    token = float(torch.cumprod(torch.clamp(p_x / q_x, max=1.0), dim=0).sum())
    w = block_weights(p_x, q_x)  # (k,) w_1..w_k
    r = torch.cat([residual_mass(w[:-1], p[1:k], q[1:k]), w[-1:]])  # (k,) r_1..r_{k-1}, then r_k = w_k
    denom = r + 1.0 - w
    h = torch.where(denom > 0, r / denom.clamp(min=1e-300), 0.0)  # (k,) stop probability at i = 1..k
    later_no_stop = torch.cat([torch.cumprod((1.0 - h).flip(0), dim=0).flip(0)[1:], torch.ones(1, dtype=h.dtype)])
    tau = h * later_no_stop  # (k,) Pr(tau = i), i = 1..k
    block = float((tau * (idx + 1)).sum())
    return token, block


class Recorder:
    """Wraps ``ops.spec_sample``: per sampled round (k_b > 0, a real q), the two expectations and what happened."""

    def __init__(self):
        self.rounds: list[dict] = []
        self.label = ""
        self._real = ops.spec_sample

    def __call__(self, draft_ids, cu, draft_probs, target_probs, target_argmax, is_greedy, onehot, *rest):
        out, num_accepted = self._real(draft_ids, cu, draft_probs, target_probs, target_argmax, is_greedy, onehot,
                                       *rest)
        cu_list = cu.tolist()
        for b in range(len(cu_list) - 1):
            start, end = cu_list[b], cu_list[b + 1]
            if end == start or bool(is_greedy[b]) or bool(onehot[b]) or draft_probs is None:
                continue
            token, block = expected_accepted(target_probs[start + b : end + b + 1].cpu(),
                                             draft_probs[start:end].cpu(), draft_ids[start:end].cpu())
            self.rounds.append({"class": self.label, "k": end - start, "token": token, "block": block,
                                "sampled": int(num_accepted[b])})
        return out, num_accepted


def summary(rounds: list[dict]) -> dict:
    n = len(rounds)
    token = sum(r["token"] for r in rounds) / n
    block = sum(r["block"] for r in rounds) / n
    diffs = [r["block"] - r["token"] for r in rounds]
    mean_diff = sum(diffs) / n
    se = math.sqrt(sum((d - mean_diff) ** 2 for d in diffs) / max(n - 1, 1) / n)
    return {"rounds": n, "mean_k": sum(r["k"] for r in rounds) / n, "token_accepted": token,
            "block_accepted": block, "block_minus_token": mean_diff, "se_block_minus_token": se,
            "token_tokens_per_round": token + 1, "block_tokens_per_round": block + 1,
            "tokens_per_round_ratio": (block + 1) / (token + 1),
            "min_block_minus_token": min(diffs), "sampled_token_accepted": sum(r["sampled"] for r in rounds) / n}


def _results(recorder: Recorder, prompts: dict) -> dict:
    if not recorder.rounds:
        return {}
    results = {"all": summary(recorder.rounds)}
    results.update({cls: summary([r for r in recorder.rounds if r["class"] == cls])
                    for cls in prompts if any(r["class"] == cls for r in recorder.rounds)})
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.acceptance.block_verify",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", default="qwen-1.5b", help="folder, or smollm2 | qwen-0.5b | qwen-1.5b")
    parser.add_argument("--draft", default="qwen-0.5b", help="the draft model (folder or alias)")
    parser.add_argument("--k", type=int, default=4)
    parser.add_argument("--temperature", type=float, default=0.8)
    parser.add_argument("--prompts", default=",".join(PROMPT_CLASSES), help="comma-separated prompt classes")
    parser.add_argument("--prompts-per-class", type=int, default=None, help="the first N files of each class")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--seed", type=int, default=0)
    add_record_flag(parser)
    args = parser.parse_args(argv)
    if args.temperature <= 0:
        raise SystemExit("--temperature must be > 0: greedy rows are verified token-wise by both rules")

    set_threads(args.threads)
    warm_up_sampling()
    meta = machine_info()
    target_path, draft_path = resolve_model(args.target), resolve_model(args.draft)
    prompts = load_prompts(args.prompts.split(","), args.prompts_per_class)
    tokenizer = Tokenizer.from_dir(target_path)
    # prepacked weight copies and a large KV pool would double the memory; acceptance does not depend on them
    llm = specdec.LLM(target_path, dtype=args.dtype, seed=args.seed, prepack_weights=False, kv_cache_memory_gb=0.25,
                      speculative=specdec.SpeculativeConfig(draft_model=draft_path, num_speculative_tokens=args.k))
    recorder = Recorder()
    name = "_".join(["block_verify", slug(Path(target_path).name), slug(Path(draft_path).name), f"k{args.k}",
                     f"T{args.temperature:g}", f"t{args.threads}"])
    meta.update({"target": target_path, "draft": draft_path, "k": args.k, "temperature": args.temperature,
                 "max_tokens": args.max_tokens, "dtype": args.dtype, "threads": args.threads,
                 "prompts": {cls: [p.name for p in ps] for cls, ps in prompts.items()},
                 "command": "python -m bench.acceptance.block_verify "
                            + " ".join(sys.argv[1:] if argv is None else argv)})
    ops.spec_sample = recorder  # verify() looks ops.spec_sample up at call time
    start = time.perf_counter()
    try:
        for cls, ps in prompts.items():
            recorder.label = cls
            for i, p in enumerate(ps):
                params = specdec.SamplingParams(temperature=args.temperature, max_tokens=args.max_tokens,
                                                seed=args.seed + i)
                llm.generate(prompt_token_ids=[chat_token_ids(tokenizer, p.text)], sampling_params=params)
                # written after every prompt, so that a run cut short (a shared machine's OOM killer) keeps its data
                path = write_json(name, {"meta": {**meta, "complete": False}, "results": _results(recorder, prompts)},
                                  record=args.record)
            print(f"  {cls}: {sum(r['class'] == cls for r in recorder.rounds)} rounds "
                  f"({time.perf_counter() - start:.0f}s)", flush=True)
    finally:
        ops.spec_sample = recorder._real
    results = _results(recorder, prompts)
    print(f"\n{Path(target_path).name} <- {Path(draft_path).name}, k={args.k}, T={args.temperature:g}: exact expected "
          "accepted drafts per round (same blocks, same contexts)")
    print(f"{'class':>6} {'rounds':>6} {'token':>7} {'block':>7} {'diff':>8} {'+-se':>7} {'tau ratio':>9} "
          f"{'sampled':>7}")
    for cls, s in results.items():
        print(f"{cls:>6} {s['rounds']:>6} {s['token_accepted']:7.3f} {s['block_accepted']:7.3f} "
              f"{s['block_minus_token']:8.4f} {s['se_block_minus_token']:7.4f} {s['tokens_per_round_ratio']:9.4f} "
              f"{s['sampled_token_accepted']:7.3f}")
    path = write_json(name, {"meta": {**meta, "complete": True}, "results": results}, record=args.record)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
