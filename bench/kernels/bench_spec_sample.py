"""Benchmark: fused speculative verification vs the unfused torch sequence it replaces.

    python -m bench.kernels.bench_spec_sample [--batch 1 8 64] [--k 1 4 8] [--vocab 128256]

Two measurements per (batch, k):
  verify  - the verification step alone on the same standardized p and q: the Triton kernel ``spec_sample``
            vs its torch reference (accept/reject -> residual -> bonus as separate torch ops);
  full    - standardization of p and q (softmax -> top-k/top-p) plus verification: the ``specdec.ops`` path
            (Triton kernels where they exist) vs the torch references end to end.
On CUDA, times come from ``triton.testing.do_bench`` and the kernel's bandwidth is reported as GB/s over the
bytes it must read (one p row per request, one q row more after a rejection by a draft model, and the
scalars). On CPU only the references are timed (the interpreter's speed means nothing), on a reduced sweep,
with the torch thread count recorded. Results go to ``bench/out/spec_sample_<device>.{csv,json}`` (``--record``:
the tracked ``bench/results/``); a plot too if matplotlib is importable. All rows are sampled (greedy rows skip
the vocabulary loop: not the worst case).
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import platform
import statistics
import time
from functools import partial

import torch

from bench.common import add_record_flag, results_dir
from specdec import ops
from specdec.kernels.softmax import softmax_with_temperature_reference
from specdec.kernels.spec_sample import spec_sample, spec_sample_reference
from specdec.kernels.top_k_top_p import top_k_top_p_min_p_reference

TEMPERATURE, TOP_K, TOP_P = 0.8, 50, 0.9


def make_inputs(batch: int, k: int, vocab: int, device: str, seed: int = 0) -> dict:
    """Logits for k drafts + 1 bonus row per request (every request drafts k tokens) and the drafts from q."""
    gen = torch.Generator(device=device).manual_seed(seed)
    num_total = batch * k
    target_logits = 3.0 * torch.randn(num_total + batch, vocab, generator=gen, device=device)  # (N + B, V)
    rows = torch.arange(num_total + batch, device=device)
    is_draft_row = rows % (k + 1) != k  # (N + B,) target rows that have a draft (the last row is the bonus)
    draft_logits = target_logits[is_draft_row] + 0.3 * torch.randn(num_total, vocab, generator=gen, device=device)
    settings = sampling_settings(num_total + batch, device)
    q = standardize_reference(draft_logits, *(s[:num_total] for s in settings))
    drafts = torch.multinomial(q, 1, generator=gen).squeeze(1)  # (N,) setup only, not timed
    return {
        "target_logits": target_logits,
        "draft_logits": draft_logits,
        "draft_token_ids": drafts,
        "cu_num_draft_tokens": (torch.arange(batch + 1, device=device) * k).to(torch.int32),
        "is_greedy": torch.zeros(batch, dtype=torch.bool, device=device),
        "draft_is_onehot": torch.zeros(batch, dtype=torch.bool, device=device),
        "seeds": torch.randint(0, 2**62, (batch,), generator=gen, device=device),
        "positions": torch.randint(0, 4096, (batch,), generator=gen, device=device),
        "max_num_draft_tokens": k,
    }


def sampling_settings(rows: int, device: str) -> tuple[torch.Tensor, ...]:
    """(temperature, top_k, top_p, min_p) per row."""
    return (
        torch.full((rows,), TEMPERATURE, device=device),
        torch.full((rows,), TOP_K, dtype=torch.int64, device=device),
        torch.full((rows,), TOP_P, device=device),
        torch.zeros(rows, device=device),
    )


def standardize_reference(logits, temperature, top_k, top_p, min_p) -> torch.Tensor:
    probs, _ = softmax_with_temperature_reference(logits, temperature)
    return top_k_top_p_min_p_reference(probs, top_k, top_p, min_p)


def standardize_ops(logits, temperature, top_k, top_p, min_p) -> torch.Tensor:
    probs, _ = ops.softmax_with_temperature(logits, temperature)
    return ops.top_k_top_p_min_p(probs, top_k, top_p, min_p)


def verify_args(inputs: dict, standardize) -> dict:
    """``spec_sample`` arguments with p and q standardized by ``standardize``."""
    num_total = inputs["draft_token_ids"].shape[0]
    settings = sampling_settings(inputs["target_logits"].shape[0], inputs["target_logits"].device)
    return {
        "draft_token_ids": inputs["draft_token_ids"],
        "cu_num_draft_tokens": inputs["cu_num_draft_tokens"],
        "draft_probs": standardize(inputs["draft_logits"], *(s[:num_total] for s in settings)),
        "target_probs": standardize(inputs["target_logits"], *settings),
        "target_argmax": inputs["target_logits"].argmax(dim=-1),
        "is_greedy": inputs["is_greedy"],
        "draft_is_onehot": inputs["draft_is_onehot"],
        "seeds": inputs["seeds"],
        "positions": inputs["positions"],
        "max_num_draft_tokens": inputs["max_num_draft_tokens"],
    }


def kernel_bytes(args: dict, num_accepted: torch.Tensor) -> int:
    """Bytes the fused kernel must read and write for this outcome (p/q rows it scans, scalars, outputs)."""
    batch, vocab = args["seeds"].shape[0], args["target_probs"].shape[1]
    num_drafts = (args["cu_num_draft_tokens"][1:] - args["cu_num_draft_tokens"][:-1]).long()
    rejected = int((num_accepted.long() < num_drafts).sum())
    examined = int(torch.minimum(num_accepted.long() + 1, num_drafts).sum())  # drafts whose p(x), q(x) were read
    row_bytes = 4 * vocab * (batch + rejected)  # one p row per request, one q row per rejection
    scalar_bytes = examined * (8 + 4 + 4 + 8) + batch * (4 + 1 + 1 + 8 + 8 + 8)  # draft, p(x), q(x), argmax; meta
    output_bytes = batch * (8 * (args["max_num_draft_tokens"] + 1) + 4)
    return row_bytes + scalar_bytes + output_bytes


def time_ms(fn, device: str, reps: int) -> float:
    """Median milliseconds: ``do_bench`` on CUDA, wall clock on CPU."""
    if device == "cuda":
        import triton.testing

        return float(triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median"))
    fn()  # warm-up
    samples = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        samples.append((time.perf_counter() - start) * 1e3)
    return statistics.median(samples)


def full_step(inputs: dict, standardize, verify):
    """Standardize p and q from logits, then verify: the whole step the fused kernel sits in."""
    return verify(**verify_args(inputs, standardize))


def run(batches, ks, vocab: int, device: str, reps: int) -> list[dict]:
    rows = []
    for batch in batches:
        for k in ks:
            inputs = make_inputs(batch, k, vocab, device)
            args = verify_args(inputs, standardize_reference)
            row = {"device": device, "batch": batch, "k": k, "vocab": vocab}
            row["verify_torch_ms"] = time_ms(partial(spec_sample_reference, **args), device, reps)
            row["full_torch_ms"] = time_ms(
                partial(full_step, inputs, standardize_reference, spec_sample_reference), device, reps
            )
            if device == "cuda":
                _, num_accepted = spec_sample(**args)
                row["verify_fused_ms"] = time_ms(partial(spec_sample, **args), device, reps)
                row["verify_fused_GBps"] = kernel_bytes(args, num_accepted) / (row["verify_fused_ms"] * 1e6)
                row["verify_speedup"] = row["verify_torch_ms"] / row["verify_fused_ms"]
                try:
                    row["full_fused_ms"] = time_ms(partial(full_step, inputs, standardize_ops, ops.spec_sample),
                                                   device, reps)  # fmt: skip
                    row["full_speedup"] = row["full_torch_ms"] / row["full_fused_ms"]
                except NotImplementedError as err:  # a standardization kernel is not written yet
                    print(f"full fused path skipped: {err}")
            else:
                _, num_accepted = spec_sample_reference(**args)
            row["mean_accepted"] = float(num_accepted.float().mean())
            rows.append(row)
            print(", ".join(f"{key}={value:.3f}" if isinstance(value, float) else f"{key}={value}"
                            for key, value in row.items()), flush=True)  # fmt: skip
    return rows


def save(rows: list[dict], device: str, meta: dict, record: bool = False) -> None:
    folder = results_dir(record)
    folder.mkdir(parents=True, exist_ok=True)
    stem = folder / f"spec_sample_{device}"
    columns = list(dict.fromkeys(key for row in rows for key in row))
    with open(stem.with_suffix(".csv"), "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=columns)
        writer.writeheader()
        writer.writerows(rows)
    stem.with_suffix(".json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=2))
    print(f"wrote {stem}.csv and {stem}.json")
    try:
        import matplotlib.pyplot as plt
    except ImportError:
        return
    fig, ax = plt.subplots(figsize=(7, 4))
    for k in sorted({row["k"] for row in rows}):
        sel = [row for row in rows if row["k"] == k]
        ax.plot([r["batch"] for r in sel], [r["verify_torch_ms"] for r in sel], "--", label=f"torch k={k}")
        if "verify_fused_ms" in sel[0]:
            ax.plot([r["batch"] for r in sel], [r["verify_fused_ms"] for r in sel], "-", label=f"fused k={k}")
    ax.set(xscale="log", yscale="log", xlabel="batch", ylabel="ms", title=f"spec_sample verify, V={rows[0]['vocab']}")
    ax.legend(fontsize=7)
    fig.savefig(stem.with_suffix(".png"), dpi=120, bbox_inches="tight")


def main() -> None:
    cuda = torch.cuda.is_available()
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 4, 16, 64] if cuda else [1, 8])
    parser.add_argument("--k", type=int, nargs="+", default=[1, 2, 4, 8] if cuda else [1, 4])
    parser.add_argument("--vocab", type=int, default=128256)
    parser.add_argument("--reps", type=int, default=3, help="CPU repetitions (median); CUDA uses do_bench")
    add_record_flag(parser)
    opts = parser.parse_args()
    device = "cuda" if cuda else "cpu"
    meta = {
        "device": torch.cuda.get_device_name() if cuda else platform.processor() or platform.machine(),
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "load_average_1min": os.getloadavg()[0],  # shared machines: CPU timings are only as good as this
        "sampling": {"temperature": TEMPERATURE, "top_k": TOP_K, "top_p": TOP_P},
    }
    print(meta)
    save(run(opts.batch, opts.k, opts.vocab, device, opts.reps), device, meta, opts.record)


if __name__ == "__main__":
    main()
