"""The row-invariant bf16 GEMM (kernels/cpu/gemm_bf16.c) against oneDNN's prepacked bf16 linear (what a bf16
``Linear`` ran before), interleaved, on SmolLM2-135M and Qwen2.5-0.5B shapes. Prints ms per call and the ratio.

    python bench/experiments/20261128_invariant/gemm_speed.py [--threads 1] [--rows 1 5 8 40 512]
"""
import argparse
import json
import time

import torch

from specdec.kernels.cpu import gemm

SHAPES = {"smollm2": [(960, 576), (576, 576), (3072, 576), (576, 1536), (49152, 576)],
          "qwen0.5b": [(1152, 896), (896, 896), (9728, 896), (896, 4864), (151936, 896)]}


def timed(fn, reps):
    fn()
    t0 = time.perf_counter()
    for _ in range(reps):
        fn()
    return (time.perf_counter() - t0) / reps * 1e3


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 5, 8, 40, 512])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    rows_out = []
    for model, shapes in SHAPES.items():
        for n, k in shapes:
            w = torch.randn(n, k, dtype=torch.bfloat16) * 0.02
            onednn = torch.ops.mkldnn._reorder_linear_weight(w, 8)
            packed = gemm.pack_bf16(w)
            for m in args.rows:
                x = torch.randn(m, k, dtype=torch.bfloat16)
                reps = max(1, int(2e8 / (n * k * max(m, 8))))
                a, b = [], []
                for _ in range(args.rounds):  # interleaved
                    a.append(timed(lambda: torch.ops.mkldnn._linear_pointwise(x, onednn, None, "none", [], ""), reps))
                    b.append(timed(lambda: gemm.gemm_bf16(x, packed, n), reps))
                row = dict(model=model, n=n, k=k, rows=m, onednn_ms=min(a), invariant_ms=min(b),
                           speedup=min(a) / min(b))
                rows_out.append(row)
                print(f"{model:9s} {n:6d}x{k:5d} M={m:4d}  oneDNN {min(a):8.3f} ms  invariant {min(b):8.3f} ms  "
                      f"ratio {min(a) / min(b):5.2f}", flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(dict(threads=args.threads, rows=rows_out, cpu=open("/proc/cpuinfo").read().split("model name")[1]
                           .split("\n")[0].strip(": ")), f, indent=1)


if __name__ == "__main__":
    main()
