"""The row-invariant CPU attention (kernels/cpu/attention.c) against the SDPA reference path it replaces,
interleaved, on SmolLM2-135M's head shape (9 query heads, 3 KV heads, dim 64), bf16 cache. ms per layer call.

    python bench/experiments/20261128_invariant/attention_speed.py [--threads 1]
"""
import argparse
import json
import time

import torch

from specdec.kernels.cpu.attention import paged_attention_invariant
from specdec.kernels.paged_attention_reference import paged_attention_reference

CASES = [  # (name, batch, q_len, context)
    ("decode b1 ctx 256", 1, 1, 256), ("decode b1 ctx 1024", 1, 1, 1024), ("window 5 ctx 256", 1, 5, 256),
    ("window 5 ctx 1024", 1, 5, 1024), ("decode b8 ctx 512", 8, 1, 512), ("window 5 b8 ctx 512", 8, 5, 512),
    ("prefill 128", 1, 128, 128), ("prefill 512", 1, 512, 512),
]


def timed(fn, reps):
    fn()
    t0 = time.perf_counter()
    for _ in range(reps):
        fn()
    return (time.perf_counter() - t0) / reps * 1e3


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    hq, hkv, d, bs = 9, 3, 64, 16
    rows = []
    for name, b, ql, ctx in CASES:
        nb_per = -(-ctx // bs)
        kc = torch.randn(b * nb_per + 1, bs, hkv, d, dtype=torch.bfloat16)
        vc = torch.randn_like(kc)
        tables = torch.randperm(b * nb_per).int().view(b, nb_per) + 1
        lens = torch.full((b,), ctx, dtype=torch.int32)
        cu = torch.arange(b + 1, dtype=torch.int32) * ql
        q = torch.randn(b * ql, hq, d, dtype=torch.bfloat16)
        reps = max(3, int(3e7 / (b * ql * ctx * hq * d)))
        a, c = [], []
        for _ in range(3):
            a.append(timed(lambda: paged_attention_reference(q, kc, vc, tables, lens, cu, d ** -0.5), reps))
            c.append(timed(lambda: paged_attention_invariant(q, kc, vc, tables, lens, cu, d ** -0.5), reps))
        rows.append(dict(case=name, sdpa_ms=min(a), invariant_ms=min(c), speedup=min(a) / min(c)))
        print(f"{name:22s} SDPA {min(a):8.3f} ms  invariant {min(c):8.3f} ms  ratio {min(a) / min(c):5.2f}", flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(dict(threads=args.threads, rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
