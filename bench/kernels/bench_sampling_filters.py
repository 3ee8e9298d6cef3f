"""Microbenchmark of the sampling filters: temperature softmax and top-k/top-p/min-p, Triton vs torch reference.

    python -m bench.kernels.bench_sampling_filters [--batch 1 8 64] [--vocab 128256 151936] [--peak-gbps 3350]

On CUDA both implementations are timed with ``triton.testing.do_bench`` and reported as time, GB/s and % of
``--peak-gbps``. Bandwidth counts the compulsory traffic only (each row read once, written once): the softmax
reads it twice and the filter reads it 4 + 9 * (filters on) times (see below), so for the filter the figure says
how far it is from one streaming pass, not what DRAM delivered. On a machine without CUDA only the references
(the CPU path of ``specdec.ops``) are timed, over a reduced sweep, with ``torch.get_num_threads()`` recorded; the
Triton kernel is reported as unmeasured. Results go to ``bench/out/sampling_filters_<device>.{csv,json}`` (and a
plot when matplotlib is installed); with ``--record``, to the tracked ``bench/results/``.

Passes over the row of the top-k/top-p kernel (:func:`filter_passes`) are counted from each algorithm's structure
on the benchmark's own rows, not measured: the radix select reads the row 8 times per active filter (32-bit keys,
4 bits per pass), the bisection it replaced ``ceil(log2(n))`` times at most (n bit patterns in its search range:
``max_bits - min_bits + 1`` for top-k, ``max_bits - k_bits + 1`` for top-p; the exact count is that or one less).
Both also read the row for the max/min, the kept mass (top-p on), the kept sum and the write.
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import json
import platform
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch

from bench.common import add_record_flag, results_dir
from specdec.kernels import softmax, top_k_top_p

DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


@dataclasses.dataclass
class Result:
    op: str  # "softmax" | "top_k_top_p"
    impl: str  # "triton" | "torch"
    device: str
    batch: int
    vocab: int
    ms: float  # median time per call
    gbps: float  # compulsory bytes / time
    pct_peak: float | None  # gbps / --peak-gbps
    threads: int  # torch.get_num_threads() (CPU timings)
    passes_old: float | None = None  # top_k_top_p: mean passes over a row, bisection kernel (structural bound)
    passes_new: float | None = None  # top_k_top_p: mean passes over a row, radix-select kernel (structural)


def _time_cuda(fn: Callable[[], object]) -> float:
    import triton.testing

    return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")


def _time_cpu(fn: Callable[[], object], repeats: int) -> float:
    fn()  # warm-up (allocator, first-call dispatch)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def _ceil_log2(n: torch.Tensor) -> torch.Tensor:
    """ceil(log2(n)) of positive int64 counts, exactly (no float rounding)."""
    steps = torch.zeros_like(n)
    while bool((n > 1).any()):
        steps += (n > 1).long()
        n = (n + 1) // 2
    return steps


def filter_passes(probs: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> dict[str, torch.Tensor]:
    """Passes over each row of the top-k/top-p kernel, per part, for the bisection (``*_old``) and the radix
    select (``*_new``), counted from the algorithms' structure (see the module docstring). int64 ``[R]`` each."""
    p = probs.detach().float().cpu()
    vocab = p.shape[-1]
    keys = p.view(torch.int32).long().clamp(min=0)  # (R, V) fp32 bit patterns, -0.0 -> 0
    max_bits, min_bits = keys.max(-1).values, keys.min(-1).values
    k = top_k.detach().cpu().long()
    k_on = (k > 0) & (k < vocab)
    kth = keys.sort(-1, descending=True).values.gather(-1, (torch.where(k_on, k, 1) - 1)[:, None])[:, 0]
    k_bits = torch.where(k_on, kth, min_bits)
    p_on = top_p.detach().cpu() < 1
    top_k_old = torch.where(k_on, _ceil_log2(max_bits - min_bits + 1), 0)
    top_p_old = torch.where(p_on, _ceil_log2(max_bits - k_bits + 1), 0)
    radix = top_k_top_p.RADIX_SELECT_PASSES
    top_k_new, top_p_new = k_on.long() * radix, p_on.long() * radix
    fixed = 1 + p_on.long() + 2  # max/min, kept mass (top-p on), kept sum + write
    return {
        "top_k_old": top_k_old,
        "top_k_new": top_k_new,
        "top_p_old": top_p_old,
        "top_p_new": top_p_new,
        "total_old": fixed + top_k_old + top_p_old,
        "total_new": fixed + top_k_new + top_p_new,
    }


def _filter_inputs(batch: int, vocab: int, device: str, logits_dtype: torch.dtype, seed: int = 0):
    """(logits, temperature, probs, top_k, top_p, min_p) of one shape, with typical mixed per-row settings."""
    g = torch.Generator().manual_seed(seed)
    logits = (torch.randn(batch, vocab, generator=g) * 3).to(device=device, dtype=logits_dtype)  # (B, V)
    temperature = torch.linspace(0.5, 1.2, batch).to(device)  # (B,)
    probs = torch.softmax(logits.float() / temperature[:, None], dim=-1)  # (B, V) fp32
    top_k = torch.tensor([50, 0, 20, 0], dtype=torch.int64).repeat(batch // 4 + 1)[:batch].to(device)
    top_p = torch.tensor([1.0, 0.9, 0.95, 0.8]).repeat(batch // 4 + 1)[:batch].to(device)
    min_p = torch.tensor([0.0, 0.0, 0.05, 0.0]).repeat(batch // 4 + 1)[:batch].to(device)
    return logits, temperature, probs, top_k, top_p, min_p


def _cases(batch: int, vocab: int, device: str, logits_dtype: torch.dtype, seed: int = 0):
    """(op, compulsory bytes, {impl: fn}) for one shape, with typical mixed per-row settings."""
    logits, temperature, probs, top_k, top_p, min_p = _filter_inputs(batch, vocab, device, logits_dtype, seed)
    softmax_bytes = batch * vocab * (logits.element_size() + 4)  # read logits, write fp32 probs
    filter_bytes = batch * vocab * 8  # read fp32 probs, write fp32 probs
    yield (
        "softmax",
        softmax_bytes,
        {
            "triton": lambda: softmax.softmax_with_temperature(logits, temperature),
            "torch": lambda: softmax.softmax_with_temperature_reference(logits, temperature),
        },
    )
    yield (
        "top_k_top_p",
        filter_bytes,
        {
            "triton": lambda: top_k_top_p.top_k_top_p_min_p(probs, top_k, top_p, min_p),
            "torch": lambda: top_k_top_p.top_k_top_p_min_p_reference(probs, top_k, top_p, min_p),
        },
    )


def run(batches: list[int], vocabs: list[int], logits_dtype: torch.dtype, peak_gbps: float | None) -> list[Result]:
    cuda = torch.cuda.is_available()
    device = "cuda" if cuda else "cpu"
    results = []
    for vocab in vocabs:
        for batch in batches:
            _, _, probs, top_k, top_p, _ = _filter_inputs(batch, vocab, device, logits_dtype)
            passes = filter_passes(probs, top_k, top_p)
            mean = {name: value.double().mean().item() for name, value in passes.items()}
            text = f"top_k_top_p passes over the row (structural count, bisection -> radix), B={batch:3d} V={vocab:6d}:"
            for part in ("top_k", "top_p"):  # mean over the rows where the filter is on
                on = passes[f"{part}_new"] > 0
                if not bool(on.any()):
                    text += f" {part} off,"
                    continue
                old, new = (passes[f"{part}_{alg}"][on].double().mean().item() for alg in ("old", "new"))
                text += f" {part} {old:.1f} -> {new:.0f} ({int(on.sum())}/{batch} rows on),"
            print(f"{text} total per row {mean['total_old']:.1f} -> {mean['total_new']:.1f}")
            for op, num_bytes, impls in _cases(batch, vocab, device, logits_dtype):
                extra = (mean["total_old"], mean["total_new"]) if op == "top_k_top_p" else (None, None)
                for impl, fn in impls.items():
                    if impl == "triton" and not cuda:
                        print(f"{op:12s} triton B={batch:3d} V={vocab:6d} unmeasured: no CUDA")
                        continue  # compiled Triton needs a GPU
                    ms = _time_cuda(fn) if cuda else _time_cpu(fn, repeats=5 if batch * vocab > 2**22 else 10)
                    gbps = num_bytes / (ms * 1e-3) / 1e9
                    pct = 100 * gbps / peak_gbps if peak_gbps else None
                    threads = torch.get_num_threads()
                    results.append(Result(op, impl, device, batch, vocab, ms, gbps, pct, threads, *extra))
                    pct_text = f" {pct:5.1f}% of peak" if pct is not None else ""
                    print(f"{op:12s} {impl:6s} B={batch:3d} V={vocab:6d} {ms:9.3f} ms {gbps:9.2f} GB/s{pct_text}")
    return results


def _device_tag() -> str:
    if torch.cuda.is_available():
        return torch.cuda.get_device_name().replace(" ", "_")
    return f"cpu_{platform.machine()}"


def save(results: list[Result], meta: dict, record: bool = False) -> Path:
    folder = results_dir(record)
    folder.mkdir(parents=True, exist_ok=True)
    stem = folder / f"sampling_filters_{_device_tag()}"
    rows = [dataclasses.asdict(r) for r in results]
    with open(stem.with_suffix(".csv"), "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    stem.with_suffix(".json").write_text(json.dumps({"meta": meta, "results": rows}, indent=1))
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return stem
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for ax, op in zip(axes, ("softmax", "top_k_top_p")):
        for impl in ("triton", "torch"):
            for vocab in sorted({r.vocab for r in results}):
                sel = [r for r in results if (r.op, r.impl, r.vocab) == (op, impl, vocab)]
                if sel:
                    ax.plot([r.batch for r in sel], [r.ms for r in sel], marker="o", label=f"{impl} V={vocab}")
        ax.set(title=op, xlabel="batch (rows)", ylabel="ms", xscale="log", yscale="log")
        ax.legend()
    fig.tight_layout()
    fig.savefig(stem.with_suffix(".png"), dpi=120)
    return stem


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    cuda = torch.cuda.is_available()
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32, 64] if cuda else [1, 4, 16])
    parser.add_argument("--vocab", type=int, nargs="+", default=[128256, 151936])
    parser.add_argument("--logits-dtype", choices=sorted(DTYPES), default="bf16")
    parser.add_argument("--peak-gbps", type=float, default=None, help="peak DRAM bandwidth, e.g. 3350 for H100 SXM")
    add_record_flag(parser)
    args = parser.parse_args()
    results = run(args.batch, args.vocab, DTYPES[args.logits_dtype], args.peak_gbps)
    meta = {
        "device": torch.cuda.get_device_name() if cuda else platform.processor() or platform.machine(),
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "logits_dtype": args.logits_dtype,
        "peak_gbps": args.peak_gbps,
        "timer": "triton.testing.do_bench (median)" if cuda else "time.perf_counter (median)",
    }
    print(f"wrote {save(results, meta, args.record)}.*")


if __name__ == "__main__":
    main()
