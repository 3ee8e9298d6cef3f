"""Step kernels: each kernel's achieved bandwidth against a measured device-to-device copy, and paged attention
against torch SDPA on contiguous KV of the same shape (kernels.json).

Attention: Llama-3.2-1B heads (32 q / 8 kv, head dim 64) and 3B (24 / 8 / 128), bf16, batch 1/8/64, context
512/2k/8k, a decode (q_len 1) and a k=4 verification window (q_len 5). The Triton kernel reads a shuffled paged
cache (``bench.kernels.bench_attention.make_inputs``); SDPA gets the same K/V contiguous ``[B, Hkv, ctx, D]`` with
``enable_gqa`` (a causal bool mask for the window); each row records the SDPA backend that ran (``sdpa_backend``:
the ``aten::_scaled_dot_product_*`` op torch.profiler saw under the default selection) and the backends that accept
the shape when forced one at a time (``sdpa_supported``). Bytes are ``bench_attention.bytes_moved`` (K and V once,
q and out once). Sampling: ``bench_sampling_filters`` cases (softmax, top-k/top-p) and ``bench_spec_sample.run``
(fused verification vs the torch sequence), vocab 128256. Two times per call on CUDA: ``*_ms``,
``triton.testing.do_bench(..., return_mode="median")`` per Python call (its default is the mean) - the host's
launch and planning included, as before; and ``*_graph_ms``, the GPU's work per call from CUDA graph replays over
copies of the inputs (``bench.gpu_steps.graph_timing``: what a call costs inside the engine's graphs), with GB/s
and % of copy from it, and ``*_launch_overhead_ms`` = do_bench - graph. The Triton attention is called as the
engine's static forward calls it (``paged_attention_uniform``; block tables as wide as the context).
Dry run: CPU, tiny shapes, torch references only; Triton columns and the copy ratio say "skipped: no CUDA".
"""

from __future__ import annotations

import sys
import warnings

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from bench.gpu_steps.common import copy_bandwidth_gbps, event_ms, out_of_time, parse_args, write_json
from bench.gpu_steps.graph_timing import copies, graph_columns
from bench.kernels import bench_attention, bench_sampling_filters, bench_spec_sample
from specdec.kernels.paged_attention import paged_attention_reference, paged_attention_uniform
from specdec.kernels.spec_sample import spec_sample

GRAPH_TIMER = ("CUDA graph replays: calls captured round-robin over input copies (a working set of several L2 "
               "sizes), CUDA events, median replay / calls (bench.gpu_steps.graph_timing)")


def time_ms(fn, cuda: bool) -> float:
    return bench_attention.time_ms(fn, "cuda") if cuda else event_ms(fn, reps=3, warmup=1)


# the op each backend dispatches to (a substring of the profiler's event name), in the order they are looked for
SDPA_OPS = (("_scaled_dot_product_cudnn_attention", "cudnn"),
            ("_scaled_dot_product_flash_attention_for_cpu", "flash (cpu)"),
            ("_scaled_dot_product_flash_attention", "flash"),
            ("_scaled_dot_product_efficient_attention", "efficient"),
            ("_scaled_dot_product_fused_attention_overrideable", "overrideable"),
            ("_scaled_dot_product_attention_math", "math"))  # fmt: skip
FORCEABLE = {"flash": SDPBackend.FLASH_ATTENTION, "efficient": SDPBackend.EFFICIENT_ATTENTION,
             "cudnn": SDPBackend.CUDNN_ATTENTION, "math": SDPBackend.MATH}  # fmt: skip


def sdpa_backend(fn) -> str:
    """The SDPA backend ``fn`` (one ``scaled_dot_product_attention`` call) runs under torch's default selection,
    read from the aten op torch.profiler records for it."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        fn()
    names = {e.name for e in prof.events()}
    for op, label in SDPA_OPS:
        if any(op in name for name in names):
            return label
    return "unknown (no aten::_scaled_dot_product_* op recorded)"


def sdpa_supported(fn) -> list[str]:
    """The backends that run ``fn`` when forced one at a time (``torch.nn.attention.sdpa_kernel``)."""
    ok = []
    for label, backend in FORCEABLE.items():
        try:
            with warnings.catch_warnings(), sdpa_kernel([backend]):
                warnings.simplefilter("ignore")  # "... kernel not used because ..." for each refusal
                fn()
            ok.append(label)
        except (RuntimeError, NotImplementedError, ValueError):  # "No available kernel", unsupported dtype / shape
            pass
    return ok


def sdpa_inputs(paged: tuple, batch: int, ctx: int, q_len: int):
    """The paged inputs' K/V gathered into contiguous ``[B, Hkv, ctx, D]`` and q as ``[B, Hq, q_len, D]``."""
    q, k_cache, v_cache, tables = paged[:4]
    k = k_cache[tables.long()].flatten(1, 2)[:, :ctx].transpose(1, 2).contiguous()  # (B, Hkv, ctx, D)
    v = v_cache[tables.long()].flatten(1, 2)[:, :ctx].transpose(1, 2).contiguous()
    qb = q.view(batch, q_len, q.shape[1], q.shape[2]).transpose(1, 2).contiguous()  # (B, Hq, q_len, D)
    mask = None
    if q_len > 1:  # new token i sees the context and new tokens <= i
        mask = torch.ones(q_len, ctx, dtype=torch.bool, device=q.device).tril(ctx - q_len)
    return qb, k, v, mask


def uniform_call(paged: tuple, q_len: int):
    """The Triton attention on ``make_inputs``' tuple as the engine's static forward calls it (a uniform batch)."""
    q, k_cache, v_cache, tables, seq_lens, cu_q_lens, scale = paged
    return lambda: paged_attention_uniform(q, k_cache, v_cache, tables, seq_lens, cu_q_lens, q_len, scale)


def sdpa_call(qb, k, v, mask):
    return lambda: F.scaled_dot_product_attention(qb, k, v, attn_mask=mask, enable_gqa=True)


def attention_row(model: str, batch: int, ctx: int, q_len: int, cuda: bool, copy_gbps: float | None) -> dict:
    """One shape: the Triton kernel on the paged cache and SDPA on contiguous KV (CPU: the reference instead)."""
    hq, hkv, d = bench_attention.MODELS[model]
    dtype = torch.bfloat16
    paged = bench_attention.make_inputs(batch, ctx, q_len, hq, hkv, d, dtype, "cuda" if cuda else "cpu")
    nbytes = bench_attention.bytes_moved(batch, ctx, q_len, hq, hkv, d, dtype)
    qb, k, v, mask = sdpa_inputs(paged, batch, ctx, q_len)
    row = {"model": model, "batch": batch, "ctx": ctx, "q_len": q_len, "dtype": "bfloat16", "bytes": nbytes}
    sdpa = sdpa_call(qb, k, v, mask)
    row["sdpa_ms"] = time_ms(sdpa, cuda)
    row["sdpa_backend"] = sdpa_backend(sdpa)
    row["sdpa_supported"] = sdpa_supported(sdpa)
    row["sdpa_GBps"] = nbytes / (row["sdpa_ms"] * 1e6)
    if cuda:
        row["triton_ms"] = time_ms(uniform_call(paged, q_len), cuda)
        row["triton_GBps"] = nbytes / (row["triton_ms"] * 1e6)
        row["triton_pct_copy"] = 100 * row["triton_GBps"] / copy_gbps
        row["triton_over_sdpa"] = row["sdpa_ms"] / row["triton_ms"]  # > 1: the kernel is faster
        # the GPU's work per call: graph replays over input copies (HBM, not L2, as in a decode step)
        inputs = [paged] + [bench_attention.make_inputs(batch, ctx, q_len, hq, hkv, d, dtype, "cuda")
                            for _ in range(copies(nbytes) - 1)]  # fmt: skip
        row.update(graph_columns("triton", [uniform_call(p, q_len) for p in inputs], row["triton_ms"], nbytes,
                                 copy_gbps))  # fmt: skip
        sdpa_sets = [(qb, k, v, mask)] + [sdpa_inputs(p, batch, ctx, q_len) for p in inputs[1:]]
        row.update(graph_columns("sdpa", [sdpa_call(*s) for s in sdpa_sets], row["sdpa_ms"], nbytes, copy_gbps))
        if isinstance(row["triton_graph_ms"], float) and isinstance(row["sdpa_graph_ms"], float):
            row["graph_triton_over_sdpa"] = row["sdpa_graph_ms"] / row["triton_graph_ms"]  # > 1: the kernel is faster
    else:
        row["triton_ms"] = "skipped: no CUDA"
        row["reference_ms"] = time_ms(lambda: paged_attention_reference(*paged), cuda)
    return row


def attention(args, cuda: bool, copy_gbps: float | None, rows: list[dict], save) -> None:
    batches, contexts, q_lens = ([1, 2], [16, 64], [1, 5]) if args.dry_run else ([1, 8, 64], [512, 2048, 8192], [1, 5])
    for model in bench_attention.MODELS:
        for batch in batches:
            for ctx in contexts:
                if out_of_time(args, 15):
                    return
                for q_len in q_lens:
                    row = attention_row(model, batch, ctx, q_len, cuda, copy_gbps)
                    rows.append(row)
                    print(", ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in row.items()),
                          flush=True)  # fmt: skip
                save()


def sampling(args, cuda: bool, copy_gbps: float | None, rows: list[dict], save) -> None:
    batches, vocab = ([1, 2], 512) if args.dry_run else ([1, 8, 64], 128256)
    dev = "cuda" if cuda else "cpu"
    for batch in batches:
        if out_of_time(args, 10):
            return
        for i, (op, nbytes, impls) in enumerate(bench_sampling_filters._cases(batch, vocab, dev, torch.bfloat16)):
            row = {"op": op, "batch": batch, "vocab": vocab, "bytes": nbytes}
            # the same op on other inputs (seeds 1, 2, ...): graph_timing's copies
            more = [list(bench_sampling_filters._cases(batch, vocab, dev, torch.bfloat16, seed))[i][2]
                    for seed in range(1, copies(nbytes) if cuda else 1)]  # fmt: skip
            for impl, fn in impls.items():
                if impl == "triton" and not cuda:
                    row["triton_ms"] = "skipped: no CUDA"
                    continue
                row[f"{impl}_ms"] = time_ms(fn, cuda)
                row[f"{impl}_GBps"] = nbytes / (row[f"{impl}_ms"] * 1e6)
                if cuda:
                    row.update(graph_columns(impl, [fn] + [m[impl] for m in more], row[f"{impl}_ms"], nbytes,
                                             copy_gbps))  # fmt: skip
            if cuda:
                row["triton_pct_copy"] = 100 * row["triton_GBps"] / copy_gbps
            rows.append(row)
            print(row, flush=True)
        save()


def spec_sample_graph(row: dict, vocab: int, copy_gbps: float) -> dict:
    """Graph-replay columns ``verify_fused_*`` of one ``bench_spec_sample.run`` row (CUDA): the fused verification on
    the row's inputs and on copies made with other seeds. Not its torch reference: that one reads device values on
    the host (``nonzero``), which no graph captures."""
    batch, k = row["batch"], row["k"]

    def args(seed: int) -> dict:
        return bench_spec_sample.verify_args(bench_spec_sample.make_inputs(batch, k, vocab, "cuda", seed),
                                             bench_spec_sample.standardize_reference)  # fmt: skip

    first = args(0)
    nbytes = bench_spec_sample.kernel_bytes(first, spec_sample(**first)[1])
    sets = [first] + [args(seed) for seed in range(1, copies(nbytes))]
    return graph_columns("verify_fused", [lambda a=a: spec_sample(**a) for a in sets], row["verify_fused_ms"],
                         nbytes, copy_gbps)  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    args = parse_args(__doc__.splitlines()[0], argv)
    cuda = torch.cuda.is_available() and not args.dry_run
    if not cuda:
        torch.set_num_threads(1)
    result: dict = {"device": torch.cuda.get_device_name() if cuda else "cpu", "dtype": "bfloat16",
                    "timer": "triton.testing.do_bench (return_mode='median')" if cuda else "perf_counter (median)",
                    "graph_timer": GRAPH_TIMER if cuda else "skipped: no CUDA",
                    "copy": None, "attention": [], "sampling": [], "spec_sample": []}  # fmt: skip

    def save() -> None:
        write_json(args.out / "kernels.json", result)

    if cuda:
        result["copy"] = copy_bandwidth_gbps(1024)
        print(f"device-to-device copy: {result['copy']['copy_GBps']:.0f} GB/s (read + write)", flush=True)
    else:
        result["copy"] = {**copy_bandwidth_gbps(16, reps=3), "note": "skipped: no CUDA (CPU copy, for the record)"}
    copy_gbps = result["copy"]["copy_GBps"]
    save()
    attention(args, cuda, copy_gbps, result["attention"], save)
    sampling(args, cuda, copy_gbps, result["sampling"], save)
    if not out_of_time(args, 20):
        batches, vocab = ([1, 2], 512) if args.dry_run else ([1, 8, 64], 128256)
        rows = bench_spec_sample.run(batches, [4], vocab, "cuda" if cuda else "cpu", reps=2 if args.dry_run else 3)
        for row in rows:
            if cuda and "verify_fused_GBps" in row:
                row["fused_pct_copy"] = 100 * row["verify_fused_GBps"] / copy_gbps
                row.update(spec_sample_graph(row, vocab, copy_gbps))
            elif not cuda:
                row["verify_fused_ms"] = "skipped: no CUDA"
        result["spec_sample"] = rows
        save()
    if not cuda:
        print("STATUS: skipped: no CUDA (torch references timed on CPU, tiny shapes)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
