"""What the bench's GPU timers rest on, checked on a GPU before the kernels / quant / breakdown steps use them
(``python -m bench.gpu``'s tests step runs first): ``graph_timing.graph_ms`` agrees with CUDA events on a kernel
long enough for the launch not to matter, a call that reads a device value on the host is refused as "capture
failed" and leaves CUDA usable, and torch.profiler sees the kernels inside a graph replay (what the breakdown step
classifies).

Marked ``gpu``: excluded from the default run; without CUDA every test FAILS ("needs CUDA", tests/gpu/conftest.py).
"""

from __future__ import annotations

import pytest
import torch

from bench.gpu_steps.common import event_ms
from bench.gpu_steps.graph_timing import graph_columns, graph_ms
from bench.gpu_steps.kernel_groups import classify_kernel, device_kernel_rows, group_kernels

pytestmark = pytest.mark.gpu


def test_graph_ms_agrees_with_events_on_a_long_kernel():
    src = torch.ones(64 * 2**20, device="cuda")  # 256 MiB: ~0.1-0.2 ms a copy, launch overhead negligible
    dst = torch.empty_like(src)
    per_call = graph_ms([lambda: dst.copy_(src)], min_calls=8, replays=5)
    direct = event_ms(lambda: dst.copy_(src), reps=10)
    assert 0.7 * direct < per_call < 1.3 * direct, (per_call, direct)


def test_a_host_read_is_refused_and_cuda_stays_usable():
    x = torch.ones(1024, device="cuda")
    row = graph_columns("bad", [lambda: x.sum().item()], 1.0)
    assert row["bad_graph_ms"].startswith("capture failed"), row
    ok = graph_columns("ok", [lambda: x.mul(2)], 1.0, nbytes=8 * 1024)
    assert isinstance(ok["ok_graph_ms"], float) and ok["ok_graph_ms"] > 0 and ok["ok_launch_overhead_ms"] < 1.0


def test_the_profiler_sees_kernels_inside_a_graph_replay():
    from torch.profiler import ProfilerActivity, profile

    x = torch.randn(16, 2048, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(4096, 2048, device="cuda", dtype=torch.bfloat16)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        torch.nn.functional.silu(torch.nn.functional.linear(x, w))
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        torch.nn.functional.silu(torch.nn.functional.linear(x, w))
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        graph.replay()
        torch.cuda.synchronize()
    rows = device_kernel_rows(prof.events())
    groups = group_kernels(rows)["groups"]
    names = [(name, classify_kernel(name)) for name, _, _ in rows]
    assert groups["GEMM"]["kernels"] >= 1 and groups["activation"]["kernels"] == 1, names
