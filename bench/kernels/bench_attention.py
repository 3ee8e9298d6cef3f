"""Paged attention microbenchmark: achieved memory bandwidth over the design's shapes.

    python -m bench.kernels.bench_attention [--peak-gbps 3350] [--quick] [--models Llama-3.2-1B ...]

On CUDA it times the Triton kernel (``triton.testing.do_bench``) and the torch reference (the test oracle, the
baseline) and reports GB/s = (KV bytes read + q and out bytes) / time, and the % of ``--peak-gbps``.
Without CUDA it times only the torch reference - the CPU path - on a reduced sweep, so the script runs
everywhere (the thread count is recorded). Results go to ``bench/out/`` (``--record``: the tracked
``bench/results/``) as CSV and JSON, plus a plot when matplotlib is importable.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import platform
import time

import torch

from bench.common import add_record_flag, results_dir
from specdec.kernels.paged_attention import attention_configs, paged_attention, paged_attention_reference

MODELS = {"Llama-3.2-1B": (32, 8, 64), "Llama-3.2-3B": (24, 8, 128)}  # (Hq, Hkv, D)
BLOCK_SIZE = 16
# Peak HBM bandwidth per device name fragment (GB/s), used when --peak-gbps is not given.
PEAK_GBPS = {"H200": 4800.0, "H100": 3350.0, "A100": 2039.0, "L40S": 864.0, "RTX 4090": 1008.0}


def sweep(device: str, quick: bool) -> dict[str, list[int]]:
    """Shapes to time: q_len 1 is decode, k + 1 verifies k drafted tokens."""
    if device == "cuda" and not quick:
        return {"batch": [1, 4, 16, 64], "ctx": [128, 512, 2048, 8192], "q_len": list(range(1, 10))}
    if device == "cuda":
        return {"batch": [1, 16], "ctx": [512, 4096], "q_len": [1, 5]}
    return {"batch": [1, 4], "ctx": [128, 512], "q_len": [1, 5]}


def make_inputs(batch: int, ctx: int, q_len: int, hq: int, hkv: int, d: int, dtype: torch.dtype, device: str):
    """Every sequence has context ``ctx`` (new tokens included); blocks scattered over a shuffled cache."""
    blocks_per_seq = -(-ctx // BLOCK_SIZE)
    num_blocks = batch * blocks_per_seq
    block_tables = torch.randperm(num_blocks, device=device).view(batch, blocks_per_seq).to(torch.int32)
    k_cache = torch.randn(num_blocks, BLOCK_SIZE, hkv, d, device=device, dtype=dtype)
    v_cache = torch.randn_like(k_cache)
    q = torch.randn(batch * q_len, hq, d, device=device, dtype=dtype)
    seq_lens = torch.full((batch,), ctx, dtype=torch.int32, device=device)
    cu_q_lens = torch.arange(0, batch * q_len + 1, q_len, dtype=torch.int32, device=device)
    return q, k_cache, v_cache, block_tables, seq_lens, cu_q_lens, d**-0.5


def bytes_moved(batch: int, ctx: int, q_len: int, hq: int, hkv: int, d: int, dtype: torch.dtype) -> int:
    """Minimum traffic: K and V of every context token once, q read and out written once."""
    elem = torch.empty((), dtype=dtype).element_size()
    return (2 * batch * ctx * hkv * d + 2 * batch * q_len * hq * d) * elem


def time_ms(fn, device: str) -> float:
    if device == "cuda":
        import triton.testing

        return float(triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median"))
    fn()  # warm-up
    reps, start = 0, time.perf_counter()
    while reps < 3 or time.perf_counter() - start < 0.2:
        fn()
        reps += 1
    return (time.perf_counter() - start) * 1e3 / reps


def measure(model: str, batch: int, ctx: int, q_len: int, impls: dict, dtype: torch.dtype, device: str,
            peak: float | None) -> list[dict]:  # fmt: skip
    """One shape: a result row per implementation."""
    hq, hkv, d = MODELS[model]
    inputs = make_inputs(batch, ctx, q_len, hq, hkv, d, dtype, device)
    nbytes = bytes_moved(batch, ctx, q_len, hq, hkv, d, dtype)
    cfg = attention_configs(d, hq // hkv, q_len, dtype)[0]
    rows = []
    for impl, fn in impls.items():
        ms = time_ms(lambda fn=fn: fn(*inputs), device)
        gbps = nbytes / ms / 1e6
        pct = 100 * gbps / peak if peak else None
        rows.append({
            "model": model, "impl": impl, "device": device, "dtype": str(dtype).removeprefix("torch."),
            "batch": batch, "ctx": ctx, "q_len": q_len, "ms": round(ms, 4), "gb_per_s": round(gbps, 3),
            "pct_peak": None if pct is None else round(pct, 1),
            "config": json.dumps({**cfg.constexprs, "warps": cfg.num_warps}) if impl == "triton" else "",
        })  # fmt: skip
        print(f"{model:13s} {impl:9s} B={batch:<3d} ctx={ctx:<5d} q_len={q_len}  {ms:9.3f} ms {gbps:8.1f} GB/s"
              + ("" if pct is None else f"  {pct:5.1f}% of {peak:.0f}"))  # fmt: skip
    return rows


def run(args: argparse.Namespace) -> list[dict]:
    device = "cuda" if torch.cuda.is_available() else "cpu"
    peak = args.peak_gbps
    if peak is None and device == "cuda":
        name = torch.cuda.get_device_name()
        peak = next((v for k, v in PEAK_GBPS.items() if k in name), None)
    args.peak_gbps = peak
    impls = {"reference": paged_attention_reference}
    if device == "cuda":
        impls = {"triton": paged_attention, **({} if args.no_reference else impls)}
    grid = sweep(device, args.quick)
    rows = []
    for model in args.models:
        for batch in grid["batch"]:
            for ctx in grid["ctx"]:
                for q_len in grid["q_len"]:
                    rows += measure(model, batch, ctx, q_len, impls, getattr(torch, args.dtype), device, peak)
    return rows


def write(rows: list[dict], args: argparse.Namespace) -> None:
    folder = results_dir(args.record)
    os.makedirs(folder, exist_ok=True)
    device = rows[0]["device"]
    stem = os.path.join(folder, f"bench_attention_{device}")
    with open(stem + ".csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    meta = {
        "device": torch.cuda.get_device_name() if device == "cuda" else platform.processor() or platform.machine(),
        "torch": torch.__version__, "torch_threads": torch.get_num_threads(), "peak_gbps": args.peak_gbps,
        "block_size": BLOCK_SIZE, "dtype": args.dtype,
    }  # fmt: skip
    with open(stem + ".json", "w") as f:
        json.dump({"meta": meta, "rows": rows}, f, indent=1)
    print(f"wrote {stem}.csv and {stem}.json")
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    fig, axes = plt.subplots(1, len(args.models), figsize=(6 * len(args.models), 4), squeeze=False)
    for ax, model in zip(axes[0], args.models):
        for impl in sorted({r["impl"] for r in rows}):
            for batch in sorted({r["batch"] for r in rows}):
                pts = [r for r in rows if r["model"] == model and r["impl"] == impl and r["batch"] == batch
                       and r["q_len"] == 1]  # fmt: skip
                ax.plot([r["ctx"] for r in pts], [r["gb_per_s"] for r in pts], marker="o", label=f"{impl} B={batch}")
        ax.set(xscale="log", xlabel="context", ylabel="GB/s", title=f"{model} decode ({device})")
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(stem + ".png", dpi=120)
    print(f"wrote {stem}.png")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    parser.add_argument("--dtype", default="bfloat16", choices=["float16", "bfloat16", "float32"])
    parser.add_argument("--peak-gbps", type=float, default=None, help="peak memory bandwidth for the %% column")
    parser.add_argument("--quick", action="store_true", help="a few shapes only")
    parser.add_argument("--no-reference", action="store_true", help="on CUDA, skip timing the torch reference")
    parser.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (CPU timing)")
    add_record_flag(parser)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    rows = run(args)
    write(rows, args)


if __name__ == "__main__":
    main()
