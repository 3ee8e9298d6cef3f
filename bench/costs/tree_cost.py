"""What a wider verification window costs: v(w) = forward(batch, w new tokens) / forward(batch, 1 new token).

    python -m bench.costs.tree_cost --model smollm2 --batch 1 8 --width 1 5 9 17 --context 256

A chain of k verifies w = k + 1 tokens per request, a tree of n drafted nodes w = n + 1. Trees pay when their
extra accepted tokens outweigh the extra width: per round a request gains tau tokens for about
``k_levels * c + v(w)`` decode-equivalents, so at equal draft cost a tree beats a chain iff
``tau_tree / v(w_tree) > tau_chain / v(w_chain)``. On a GPU v(w) stays near 1 at batch 1 (the forward is
memory-bound) and grows with batch size; this measures it on the machine at hand. Widths are interleaved
within each repetition (ratios are measured in one run), and the thread count is recorded.
"""

from __future__ import annotations

import argparse

import torch

from bench.common import (
    add_record_flag,
    forward_seconds,
    machine_info,
    median,
    print_table,
    resolve_model,
    set_threads,
    write_json,
)
from specdec.checkpoint.loader import load_model
from specdec.model.config import ModelConfig, resolve_dtype


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.costs.tree_cost", description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--width", type=int, nargs="+", default=[1, 5, 9, 17])
    parser.add_argument("--context", type=int, default=256)
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--reps", type=int, default=3, help="interleaved repetitions (each a median of 5 forwards)")
    parser.add_argument("--threads", type=int, default=1)
    add_record_flag(parser)
    args = parser.parse_args(argv)
    set_threads(args.threads)
    path = resolve_model(args.model)
    config = ModelConfig.from_json(path)
    dtype = resolve_dtype(args.dtype, config, torch.device("cpu"))
    model = load_model(path, dtype, torch.device("cpu"), args.context + max(args.width) + 1, config)
    seconds = {(b, w): [] for b in args.batch for w in args.width}
    for _ in range(args.reps):
        for b in args.batch:
            for w in args.width:
                seconds[(b, w)].append(forward_seconds(model, config, b, args.context, w))
    rows, results = [], []
    for b in args.batch:
        base = median(seconds[(b, 1)]) if 1 in args.width else None
        for w in args.width:
            s = median(seconds[(b, w)])
            v = s / base if base else None
            rows.append([b, w, s * 1e3, v])
            results.append({"batch": b, "width": w, "ms": s * 1e3, "v": v})
    print_table(rows, ["batch", "width", "forward ms", "v(width)"])
    payload = {"machine": machine_info(), "args": vars(args), "dtype": str(dtype), "results": results}
    print(f"wrote {write_json(f'tree_cost_{args.model}', payload, args.record)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
