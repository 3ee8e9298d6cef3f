"""Kernel times from CUDA graph replays: the GPU's work per call, without the host's launch and planning.

``triton.testing.do_bench`` launches each call from Python: a launcher's argument checks and launch plan, Triton's
dispatch, the CUDA launch itself. When those take longer than the kernel, the GPU idles between calls and the time
measured is the host's: the H100 run of 2026-11-26 timed paged attention at 0.09-0.32 ms a call by do_bench and
at 5.7 us a call inside the engine's CUDA graphs. Here ``calls`` launches are captured into one CUDA graph, the
graph is replayed, each replay timed with CUDA events, and the median replay is divided by ``calls``: what a call
costs inside the engine's graphs. ``do_bench - graph`` is the per-call launch overhead, reported apart.

The calls go round-robin over copies of the inputs (``copies``: a working set of ``L2_MULTIPLE`` L2 caches, at most
``MAX_COPIES``), so a kernel reads its weights / KV from HBM as in a decode step (gigabytes pass through L2 between
two uses of one layer's tensors) instead of from L2, where back-to-back calls on one input would find them (do_bench
flushes L2 between calls for the same reason). Small inputs stay partly L2-resident even so (the copies' count is
capped); each row records its copies.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable, Sequence

import torch

L2_MULTIPLE = 3
MAX_COPIES = 64
MIN_CALLS = 16
REPLAYS = 10


def copies(call_bytes: int, max_copies: int = MAX_COPIES, l2_bytes: int | None = None) -> int:
    """How many copies of one call's inputs (``call_bytes`` read per call) make a working set of ``L2_MULTIPLE``
    L2 caches (``l2_bytes``: the current CUDA device's by default), between 1 and ``max_copies``."""
    if l2_bytes is None:
        l2_bytes = torch.cuda.get_device_properties(torch.cuda.current_device()).L2_cache_size
    if call_bytes <= 0:
        raise ValueError(f"call_bytes must be positive, got {call_bytes}")
    return max(1, min(max_copies, math.ceil(L2_MULTIPLE * l2_bytes / call_bytes)))


def graph_ms(fns: Sequence[Callable[[], object]], min_calls: int = MIN_CALLS, replays: int = REPLAYS) -> float:
    """Median milliseconds of GPU time per call: ``fns`` (one per copy of the inputs) called round-robin, a multiple
    of ``len(fns)`` and at least ``min_calls`` calls captured into one CUDA graph, ``replays`` replays timed with
    CUDA events. Each fn runs twice first on a side stream (Triton compiles and autotunes, cuBLAS picks its kernel,
    the allocator settles), as ``StaticForwardRunner`` warms up before its captures. CUDA only; a fn that
    synchronises or reads a device value on the host cannot be captured (torch raises)."""
    if not fns:
        raise ValueError("graph_ms needs at least one function")
    calls = len(fns) * math.ceil(min_calls / len(fns))
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            for fn in fns:
                fn()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(calls):
            fns[i % len(fns)]()
    graph.replay()  # the first replay uploads the graph
    torch.cuda.synchronize()
    samples = []
    for _ in range(replays):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        samples.append(start.elapsed_time(end) / calls)
    del graph
    return statistics.median(samples)


def graph_columns(prefix: str, fns: Sequence[Callable[[], object]], do_bench_ms, nbytes: int | None = None,
                  copy_gbps: float | None = None) -> dict:
    """Row columns for one implementation timed by ``graph_ms``: ``{prefix}_graph_ms``, ``{prefix}_copies`` and,
    from them, ``{prefix}_graph_GBps`` / ``{prefix}_graph_pct_copy`` (with ``nbytes`` / ``copy_gbps``) and
    ``{prefix}_launch_overhead_ms`` = ``do_bench_ms`` (the same call timed per call) minus the graph figure. A
    capture that fails (the call syncs the host, say) is recorded as ``{prefix}_graph_ms: "capture failed: ..."``
    instead of ending the step."""
    row: dict = {f"{prefix}_copies": len(fns)}
    try:
        ms = graph_ms(fns)
    except (RuntimeError, ValueError, NotImplementedError) as err:  # capture refused: a host read or sync inside
        torch.cuda.synchronize()
        row[f"{prefix}_graph_ms"] = f"capture failed: {type(err).__name__}: {str(err).splitlines()[0][:160]}"
        return row
    row[f"{prefix}_graph_ms"] = ms
    if nbytes is not None:
        row[f"{prefix}_graph_GBps"] = nbytes / (ms * 1e6)
        if copy_gbps:
            row[f"{prefix}_graph_pct_copy"] = 100 * row[f"{prefix}_graph_GBps"] / copy_gbps
    if isinstance(do_bench_ms, (int, float)):
        row[f"{prefix}_launch_overhead_ms"] = do_bench_ms - ms
    return row
