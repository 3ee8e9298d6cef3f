"""One linear layer per call, fp32 vs bf16, packed and unpacked: the table behind the CPU dtype policy.

    python -m bench.dtype.linear [--shapes smol_lm_head qw_lm_head] [--rows 1 5 20] [--reps 5] [--threads 1]

For each weight shape (the SmolLM2-135M and Qwen2.5-0.5B projections: fused qkv, fused gate_up, down, LM head;
random weights, the same values in both dtypes) and each input row count, five ways of computing ``x @ W.T``:

  f32_lin     ``F.linear`` in float32 (MKL; what a float32 ``Linear`` runs below ``PREPACK_MIN_ROWS``)
  f32_pack    oneDNN ``_linear_pointwise`` on a float32 weight prepacked for 8 rows (float32 from 4 rows up)
  bf16_lin    ``F.linear`` in bfloat16 (oneDNN, reordering the weight on every call: bf16 "before")
  bf16_pack8  the bfloat16 weight prepacked for 8 rows (what a bfloat16 ``Linear`` runs now, from one row up)
  bf16_pack1  the bfloat16 weight prepacked for 1 row

Each figure is process CPU time per call in ms (``time.process_time``, so a loaded machine does not inflate it
the way wall time would), averaged over ``max(3, --work / (out * in))`` calls after one warm-up call, and the
minimum over ``--reps`` repetitions; the five ways are interleaved within each repetition. One torch thread by
default. Results: ``bench/out/dtype_linear_t<threads>.json`` (``--record``: the tracked ``bench/results/``).
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from functools import partial

import torch
import torch.nn.functional as F

from bench.common import add_record_flag, machine_info, print_table, set_threads, write_json

SHAPES = {  # name -> (out_features, in_features)
    "smol_qkv": (960, 576), "smol_gate_up": (3072, 576), "smol_down": (576, 1536), "smol_lm_head": (49152, 576),
    "qw_qkv": (1152, 896), "qw_gate_up": (9728, 896), "qw_down": (896, 4864), "qw_lm_head": (151936, 896),
}
ROWS = (1, 2, 3, 4, 5, 8, 20)
WAYS = ("f32_lin", "f32_pack", "bf16_lin", "bf16_pack8", "bf16_pack1")


def ms_per_call(fn: Callable[[], object], calls: int) -> float:
    """Process CPU time per call of ``fn`` in ms, over ``calls`` calls after one warm-up call."""
    fn()
    start = time.process_time()
    for _ in range(calls):
        fn()
    return (time.process_time() - start) / calls * 1e3


def packed_linear(x: torch.Tensor, packed: torch.Tensor) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")


def measure_shape(out_features: int, in_features: int, rows: list[int], reps: int, work: float) -> dict:
    """``{rows: {way: [ms per call, one per repetition]}}`` for one weight shape."""
    w32 = torch.randn(out_features, in_features) * 0.02
    w16 = w32.bfloat16()
    p32 = torch.ops.mkldnn._reorder_linear_weight(w32, 8)
    p16_8 = torch.ops.mkldnn._reorder_linear_weight(w16, 8)
    p16_1 = torch.ops.mkldnn._reorder_linear_weight(w16, 1)
    calls = max(3, int(work / (out_features * in_features)))
    out = {}
    for m in rows:
        x32 = torch.randn(m, in_features)
        x16 = x32.bfloat16()
        fns = {"f32_lin": partial(F.linear, x32, w32), "f32_pack": partial(packed_linear, x32, p32),
               "bf16_lin": partial(F.linear, x16, w16), "bf16_pack8": partial(packed_linear, x16, p16_8),
               "bf16_pack1": partial(packed_linear, x16, p16_1)}
        samples: dict[str, list[float]] = {way: [] for way in WAYS}
        for _ in range(reps):
            for way in WAYS:  # interleaved within each repetition
                samples[way].append(ms_per_call(fns[way], calls))
        out[m] = samples
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.dtype.linear", description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES),
                        help="weight shapes to time (default: all eight SmolLM2-135M and Qwen2.5-0.5B projections)")
    parser.add_argument("--rows", type=int, nargs="+", default=list(ROWS), help="input row counts (M)")
    parser.add_argument("--reps", type=int, default=5, help="repetitions per figure (the minimum is reported)")
    parser.add_argument("--work", type=float, default=2e7,
                        help="calls per timing = max(3, WORK / (out * in)): about WORK weight elements read")
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    add_record_flag(parser)
    args = parser.parse_args(argv)
    set_threads(args.threads)
    print(f"threads {torch.get_num_threads()}, torch {torch.__version__}", flush=True)
    rows, results = [], []
    for name in args.shapes:
        out_features, in_features = SHAPES[name]
        for m, samples in measure_shape(out_features, in_features, args.rows, args.reps, args.work).items():
            best = {way: min(v) for way, v in samples.items()}
            results.append({"shape": name, "out_features": out_features, "in_features": in_features, "rows": m,
                            "min_ms": best, "samples_ms": samples})
            rows.append([name, m, *(f"{best[way]:.3f}" for way in WAYS)])
            print(f"{name:13s} M={m:2d} " + " ".join(f"{way}={best[way]:.3f}" for way in WAYS), flush=True)
    print()
    print_table(rows, ["shape", "rows", *(f"{way} ms" for way in WAYS)])
    path = write_json(f"dtype_linear_t{args.threads}",
                      {"machine": machine_info(), "threads": torch.get_num_threads(), "reps": args.reps,
                       "work": args.work, "clock": "process_time", "results": results}, record=args.record)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
