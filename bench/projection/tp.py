"""On paper: what tensor parallelism TP = 1/2/4/8 would do for speculative decoding on H100 SXM with NVLink, at
batch 1 (issue 20). Nothing here is measured; every input is an assumption printed with the table.

    python -m bench.projection.tp [--allreduce vllm|trtllm] [--hbm-efficiency 0.8] [--context 1024] [--markdown]

Per forward of ``rows`` tokens (1: a decode or draft step; k + 1: a verification window) on each rank:

- **weights**: every linear's shard once (q/k/v, o, gate/up, down: 1/N each; the LM head's V/N rows), the
  replicated norms whole; bf16. Time = bytes / (HBM bandwidth x efficiency), or the FLOPs / bf16 peak when that is
  larger (never at these row counts). Plus the KV cache the rows attend to (``--context`` tokens, the rank's kv
  heads).
- **all-reduces**: ``2 L + 1`` per forward (o_proj and down_proj of every layer, the embedding), each of
  ``rows x hidden`` bf16 - 6-80 KB, latency-bound - at the latency of a published H100 NVLink measurement
  (``ALLREDUCE_US``, interpolated in message size).
- **gather**: rank 0 receives the other ranks' fp32 logits ``rows x V/N`` each: one latency (the all-reduce's)
  plus the bytes over one GPU's NVLink (450 GB/s per direction).
- **broadcast**: the int64 forward payload, one latency per forward (the command header that precedes it, a
  gloo broadcast on the host, is host work: not modelled, see below).

Then c = draft forward / target forward (1 row each) and v(k) = target forward of k + 1 rows / of 1 row, for a draft
sharded over the same N ranks (specdec's default) and for a draft on rank 0 alone (``draft_tensor_parallel_size=
1``: no collectives, all its weights on one GPU); the speedup over plain decoding at the same TP is
``bench.speed.e2e.improvement(alpha, k, c, v(k))`` (Theorem 3.8 with the verification cost), using the cheaper
placement.

Not modelled (so the figures are upper bounds on what specdec's TP does today): kernel launches and host work per
forward - specdec's TP forwards run eagerly (no CUDA graphs under TP yet), and each forward starts with a gloo
broadcast of its command header on the host; both are tens of microseconds to milliseconds, the same order as a
small model's forward on an H100. Also not modelled: overlap of communication with compute, and the draft's own
prefill/catch-up.
"""

from __future__ import annotations

import argparse
import bisect
import math

from bench.speed.e2e import improvement

HBM_BYTES_S = 3.35e12  # H100 SXM5 HBM3, NVIDIA's datasheet figure
NVLINK_BYTES_S = 450e9  # H100 SXM NVLink 4: 900 GB/s bidirectional per GPU, 450 GB/s each way
BF16_FLOPS = 989e12  # H100 SXM dense bf16 tensor-core peak (datasheet, without sparsity)

# All-reduce latency on H100 (us) by message size (bytes as labelled in the source) and TP size 2/4/8, measured
# without CUDA graphs: https://github.com/sgl-project/sglang/pull/2904 ("optimize custom allreduce kernel", H100):
# "vllm" = vLLM's custom all-reduce, "trtllm" = the TensorRT-LLM-derived custom all-reduce of that PR.
ALLREDUCE_SIZES = [512, 4096, 32768, 262144, 524288, 1048576]
ALLREDUCE_US = {
    "vllm": {2: [9.5, 8.8, 8.7, 12.9, 17.7, 26.6], 4: [9.1, 8.5, 9.2, 20.6, 26.9, 40.2],
             8: [10.1, 9.3, 11.8, 24.1, 30.4, 45.0]},
    "trtllm": {2: [3.7, 3.9, 4.5, 7.9, 12.5, 19.9], 4: [4.8, 3.7, 4.8, 13.9, 20.2, 31.1],
               8: [5.9, 5.7, 7.8, 16.7, 22.1, 33.8]},
}

# Published config.json shapes (meta-llama/Llama-3.2-1B, -3B, Llama-3.1-8B, -70B).
MODELS = {
    "Llama-3.2-1B": dict(hidden=2048, layers=16, heads=32, kv_heads=8, head_dim=64, inter=8192, vocab=128256),
    "Llama-3.2-3B": dict(hidden=3072, layers=28, heads=24, kv_heads=8, head_dim=128, inter=8192, vocab=128256),
    "Llama-3.1-8B": dict(hidden=4096, layers=32, heads=32, kv_heads=8, head_dim=128, inter=14336, vocab=128256),
    "Llama-3.1-70B": dict(hidden=8192, layers=80, heads=64, kv_heads=8, head_dim=128, inter=28672, vocab=128256),
}
PAIRS = [("Llama-3.2-3B", "Llama-3.2-1B"), ("Llama-3.1-70B", "Llama-3.1-8B")]
HBM_GB = 80  # H100 SXM memory per GPU
FIT_SHARE = 0.9  # weights (target + draft, embeddings counted untied) must leave 10% for KV, activations, CUDA
BF16 = 2


def rank_weight_bytes(m: dict, n: int) -> int:
    """Bytes of weights one forward streams on one of ``n`` ranks (bf16; the embedding lookup's few rows left
    out; kv heads split, or one replicated head when n > kv_heads)."""
    h, d = m["hidden"], m["head_dim"]
    q = m["heads"] // n * d
    kv = max(1, m["kv_heads"] // n) * d
    per_layer = h * (q + 2 * kv) + q * h + 3 * h * (m["inter"] // n) + 2 * h
    return BF16 * (m["layers"] * per_layer + math.ceil(m["vocab"] / n) * h + h)


def held_bytes(m: dict, n: int) -> int:
    """Weights one rank holds (embedding and LM head both, as untied; an upper bound for tied models)."""
    return rank_weight_bytes(m, n) + BF16 * math.ceil(m["vocab"] / n) * m["hidden"]


def allreduce_us(table: str, n: int, nbytes: int) -> float:
    """Latency of one all-reduce of ``nbytes`` on ``n`` H100s (log-linear between the measured sizes)."""
    if n == 1:
        return 0.0
    xs, ys = ALLREDUCE_SIZES, ALLREDUCE_US[table][n]
    nbytes = min(max(nbytes, xs[0]), xs[-1])  # the messages here are 6-80 KB: inside the measured range
    i = min(max(bisect.bisect_left(xs, nbytes), 1), len(xs) - 1)
    t = (math.log(nbytes) - math.log(xs[i - 1])) / (math.log(xs[i]) - math.log(xs[i - 1]))
    return ys[i - 1] + t * (ys[i] - ys[i - 1])


def forward_us(m: dict, n: int, rows: int, args) -> dict:
    """Microseconds of one forward of ``rows`` tokens on each of ``n`` ranks, by part."""
    weights = rank_weight_bytes(m, n)
    kv = 2 * m["layers"] * max(1, m["kv_heads"] // n) * m["head_dim"] * args.context * BF16
    stream = (weights + kv) / (HBM_BYTES_S * args.hbm_efficiency) * 1e6
    compute = 2 * rows * weights / BF16 / BF16_FLOPS * 1e6
    ar_one = allreduce_us(args.allreduce, n, rows * m["hidden"] * BF16)
    allreduce = (2 * m["layers"] + 1) * ar_one
    latency = allreduce_us(args.allreduce, n, 4096)
    gather = 0.0 if n == 1 else latency + rows * m["vocab"] * 4 * (n - 1) / n / NVLINK_BYTES_S * 1e6
    broadcast = 0.0 if n == 1 else latency
    total = max(stream, compute) + allreduce + gather + broadcast
    return {"stream": stream, "compute": compute, "allreduce_each": ar_one, "allreduce": allreduce,
            "gather": gather, "broadcast": broadcast, "total": total}


def project(args) -> list[dict]:
    rows = []
    for target_name, draft_name in PAIRS:
        target, draft = MODELS[target_name], MODELS[draft_name]
        for n in (1, 2, 4, 8):
            t1 = forward_us(target, n, 1, args)
            tk = forward_us(target, n, args.k + 1, args)
            d_sharded = forward_us(draft, n, 1, args)["total"]
            d_rank0 = forward_us(draft, 1, 1, args)["total"]
            c_sharded, c_rank0 = d_sharded / t1["total"], d_rank0 / t1["total"]
            c = min(c_sharded, c_rank0)
            v = tk["total"] / t1["total"]
            draft_ranks = n if c_sharded <= c_rank0 else 1
            fits = held_bytes(target, n) + held_bytes(draft, draft_ranks) < FIT_SHARE * HBM_GB * 1e9  # on rank 0
            row = {"pair": f"{target_name} / {draft_name}", "tp": n, "target_GB_per_rank": held_bytes(target, n) / 1e9,
                   "fits": fits, "t1": t1, "tk": tk, "draft_sharded_us": d_sharded, "draft_rank0_us": d_rank0,
                   "c_sharded": c_sharded, "c_rank0": c_rank0, "c": c,
                   "draft": "sharded" if c_sharded <= c_rank0 else "rank 0", "v": v,
                   "plain_tok_s": 1e6 / t1["total"]}
            for alpha in args.alphas:
                s = improvement(alpha, args.k, c, v)
                row[f"speedup_{alpha}"] = s
                row[f"spec_tok_s_{alpha}"] = s * row["plain_tok_s"]
            rows.append(row)
    return rows


def assumptions(args) -> list[str]:
    return [
        f"H100 SXM: HBM {HBM_BYTES_S / 1e12:.2f} TB/s at efficiency {args.hbm_efficiency} "
        f"(= {HBM_BYTES_S * args.hbm_efficiency / 1e12:.2f} TB/s achieved), {HBM_GB} GB; NVLink 900 GB/s "
        f"bidirectional = {NVLINK_BYTES_S / 1e9:.0f} GB/s each way per GPU; bf16 peak {BF16_FLOPS / 1e12:.0f} TFLOP/s",
        f"fits: rank 0's target + draft weights (embedding and LM head counted as untied) under {FIT_SHARE:.0%} of "
        f"{HBM_GB} GB, the rest for KV, activations and the CUDA context; TP=1 70B rows are hypothetical",
        "bf16 weights and KV; batch 1; context "
        f"{args.context} tokens; k = {args.k} (verification window {args.k + 1} rows); chain drafts",
        f"all-reduce latency: the '{args.allreduce}' row of sglang PR #2904's H100 measurement (us at 4 KB / 32 KB: "
        f"TP2 {ALLREDUCE_US[args.allreduce][2][1]}/{ALLREDUCE_US[args.allreduce][2][2]}, "
        f"TP4 {ALLREDUCE_US[args.allreduce][4][1]}/{ALLREDUCE_US[args.allreduce][4][2]}, "
        f"TP8 {ALLREDUCE_US[args.allreduce][8][1]}/{ALLREDUCE_US[args.allreduce][8][2]}); specdec calls NCCL through "
        "ProcessGroupNCCL, which is not faster than these custom kernels",
        "per forward: 2L+1 all-reduces of rows x hidden bf16; one gather of rows x V/N fp32 logits per rank "
        "(latency + bytes over NVLink); one payload broadcast (one latency)",
        "not modelled: kernel launches / host work (specdec's TP forwards run eagerly, no CUDA graphs under TP yet; "
        "each forward broadcasts a command header over gloo on the host first), comm/compute overlap; so these are "
        "upper bounds",
        "speedup = bench.speed.e2e.improvement(alpha, k, c, v(k)) over plain decoding at the same TP; c uses the "
        "cheaper draft placement (sharded over the N ranks, or on rank 0 alone)",
    ]


def fmt(x: float, digits: int = 2) -> str:
    return f"{x:.{digits}f}"


def markdown(rows: list[dict], args) -> str:
    out = ["Assumptions:", *(f"- {a}" for a in assumptions(args)), "",
           "Per-forward cost on each rank (us; target at 1 row and at the k+1 window, draft at 1 row):", "",
           "| pair | TP | target GB/rank | fits (weights < 72 GB) | weights+KV stream (1 row) | "
           "all-reduce each (1 / k+1 rows) | "
           "all-reduces (1 row) | gather (1 / k+1 rows) | target forward (1 / k+1 rows) | draft forward sharded / "
           "rank 0 |",
           "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        t1, tk = r["t1"], r["tk"]
        out.append(f"| {r['pair']} | {r['tp']} | {fmt(r['target_GB_per_rank'], 1)} | {'yes' if r['fits'] else 'no'} | "
                   f"{fmt(t1['stream'], 0)} | {fmt(t1['allreduce_each'], 1)} / {fmt(tk['allreduce_each'], 1)} | "
                   f"{fmt(t1['allreduce'], 0)} | {fmt(t1['gather'], 1)} / {fmt(tk['gather'], 1)} | "
                   f"{fmt(t1['total'], 0)} / {fmt(tk['total'], 0)} | {fmt(r['draft_sharded_us'], 0)} / "
                   f"{fmt(r['draft_rank0_us'], 0)} |")
    alphas = args.alphas
    out += ["", "c, v(k) and the projected speculative speedup (over plain decoding at the same TP) and tokens/s:", "",
            "| pair | TP | plain tok/s | c sharded / rank 0 | draft used | v(k) | "
            + " | ".join(f"speedup a={a}" for a in alphas) + " | " + " | ".join(f"spec tok/s a={a}" for a in alphas)
            + " |", "|" + "---|" * (6 + 2 * len(alphas))]
    for r in rows:
        out.append(f"| {r['pair']} | {r['tp']} | {fmt(r['plain_tok_s'], 0)} | {fmt(r['c_sharded'], 3)} / "
                   f"{fmt(r['c_rank0'], 3)} | {r['draft']} | {fmt(r['v'], 3)} | "
                   + " | ".join(fmt(r[f"speedup_{a}"]) for a in alphas) + " | "
                   + " | ".join(fmt(r[f"spec_tok_s_{a}"], 0) for a in alphas) + " |")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--allreduce", choices=sorted(ALLREDUCE_US), default="vllm")
    parser.add_argument("--markdown", action="store_true", help="(the only output format; kept for the docs' command)")
    parser.add_argument("--hbm-efficiency", type=float, default=0.8)
    parser.add_argument("--context", type=int, default=1024)
    parser.add_argument("--k", type=int, default=4)
    parser.add_argument("--alphas", type=lambda s: [float(x) for x in s.split(",")], default=[0.6, 0.7, 0.8])
    args = parser.parse_args(argv)
    print(markdown(project(args), args))


if __name__ == "__main__":
    main()
