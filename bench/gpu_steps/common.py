"""What the steps share: arguments, the deadline, JSON written as results arrive, CUDA-synchronised timing."""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[2]


def parse_args(description: str, argv: list[str] | None = None, extra: Callable | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--out", required=True, type=Path)
    parser.add_argument("--dry-run", action="store_true", help="CPU, tiny shapes")
    parser.add_argument("--deadline", type=float, default=math.inf, help="epoch seconds when this step is killed")
    if extra is not None:
        extra(parser)
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    return args


def seconds_left(args: argparse.Namespace) -> float:
    return args.deadline - time.time()


def out_of_time(args: argparse.Namespace, need_s: float) -> bool:
    """True (and says so) if less than ``need_s`` seconds are left before the deadline."""
    left = seconds_left(args)
    if left < need_s:
        print(f"stopping early: {left:.0f} s left, the next part needs ~{need_s:.0f} s", flush=True)
        return True
    return False


def write_json(path: Path, payload: dict) -> None:
    """Write atomically (a step killed mid-write leaves the previous version)."""
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(payload, indent=1, default=str) + "\n")
    os.replace(tmp, path)


def device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def synced_timed(fn: Callable[[], object]) -> tuple[float, object]:
    """``bench.common.timed`` with the GPU drained before and after: wall seconds of ``fn`` including its kernels."""
    sync()
    start = time.perf_counter()
    result = fn()
    sync()
    return time.perf_counter() - start, result


@contextlib.contextmanager
def cuda_synced_timing():
    """While open, ``bench.common.timed`` (used by ``forward_seconds``, hence ``bench.speed.e2e.measure_costs``)
    and ``bench.speed.e2e.timed`` synchronise CUDA around the timed call, so the reused CPU-era timers are right on
    a GPU."""
    import bench.common
    import bench.speed.e2e

    saved = bench.common.timed, bench.speed.e2e.timed
    bench.common.timed = bench.speed.e2e.timed = synced_timed
    try:
        yield
    finally:
        bench.common.timed, bench.speed.e2e.timed = saved


def event_ms(fn: Callable[[], object], reps: int = 20, warmup: int = 3) -> float:
    """Median milliseconds of ``fn``: CUDA events on a GPU, the wall clock on CPU."""
    for _ in range(warmup):
        fn()
    samples = []
    if torch.cuda.is_available():
        for _ in range(reps):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            samples.append(start.elapsed_time(end))
    else:
        for _ in range(reps):
            begin = time.perf_counter()
            fn()
            samples.append((time.perf_counter() - begin) * 1e3)
    return statistics.median(samples)


def copy_bandwidth_gbps(megabytes: int, reps: int = 20) -> dict:
    """Device-to-device copy (``dst.copy_(src)`` of a ``megabytes`` buffer), GB/s counting read + write (STREAM's
    convention): the ceiling the kernels' bandwidth is compared with."""
    src = torch.ones(megabytes * 2**20 // 4, dtype=torch.float32, device=device())
    dst = torch.empty_like(src)
    ms = event_ms(lambda: dst.copy_(src), reps=reps)
    return {"buffer_mb": megabytes, "ms": ms, "copy_GBps": 2 * src.numel() * 4 / (ms * 1e-3) / 1e9,
            "timer": "cuda events (median)" if torch.cuda.is_available() else "perf_counter (median)"}


# --- the engine's model runners --------------------------------------------------------------------------------
# The steps read the engine's runners (static-forward counters, the graph-path costs) through these two functions
# only: the one place to follow the engine's internals when they move.
def runners(engine) -> dict:
    """The ``ModelRunner``s of an ``LLMEngine`` by role: ``"target"`` always, ``"draft"`` when a draft model drafts
    (the draft model's own runner, on its own pool)."""
    found = {"target": engine.runner}
    draft_model = engine.speculative.proposer.draft_model if engine.speculative is not None else None
    if draft_model is not None:
        found["draft"] = draft_model.runner
    return found


def static_stats(engine) -> dict[str, dict]:
    """Per runner (``runners``), cumulative: the static-forward mode (``"cuda_graph"`` on CUDA, None when every
    forward is eager), its forwards, the static replays, the fallbacks (uniform batches no bucket served), the eager
    forwards (everything not replayed: prefill, ragged and mixed batches, fallbacks), the buckets captured, and for
    the draft model the forwards its draft loop ran (``loop_steps``: a chain round's pure steps, one program - a
    CUDA graph on CUDA - per round; specdec/runner/draft_loop.py)."""
    stats = {}
    draft_model = engine.speculative.proposer.draft_model if engine.speculative is not None else None
    for role, runner in runners(engine).items():
        static = runner.static
        replays = static.num_replays if static is not None else 0
        loop = getattr(draft_model, "loop", None) if role == "draft" else None
        loop_steps = loop.num_steps if loop is not None else 0
        stats[role] = {"mode": static.mode if static is not None else None, "forwards": runner.num_forwards,
                       "replays": replays, "fallbacks": static.num_fallbacks if static is not None else 0,
                       "loop_steps": loop_steps, "eager_forwards": runner.num_forwards - replays - loop_steps,
                       "buckets": len(static._batches) if static is not None else 0}  # fmt: skip
    return stats


def stats_delta(before: dict[str, dict], after: dict[str, dict]) -> dict[str, dict]:
    """``static_stats`` counted between two snapshots (``buckets``: captured in between). A runner whose static
    forward was turned off in between (a failed capture: the runner logs a warning) says so in ``note``."""
    delta = {}
    for role, now in after.items():
        then = before.get(role, {})
        row = {"mode": now["mode"], **{key: now[key] - then.get(key, 0) for key in
                                       ("forwards", "replays", "fallbacks", "loop_steps", "eager_forwards",
                                        "buckets")}}
        if then.get("mode") != now["mode"]:
            row = {**row, "replays": None, "fallbacks": None, "loop_steps": None, "eager_forwards": None,
                   "buckets": None,
                   "note": f"static forward {then.get('mode')} -> {now['mode']} in between (a failed capture?)"}
        delta[role] = row
    return delta


def forward_weight_bytes(model) -> int:
    """Bytes of weights one forward of ``model`` reads: every parameter once (a tied embedding once, the LM head
    reads it whole; an untied input embedding not at all, a forward reads a few rows of it), and the prepacked
    copies of linears whose plain weight was released (CPU)."""
    embed, head = model.embed_tokens.weight, model.lm_head.weight
    total = sum(p.numel() * p.element_size() for p in model.parameters()
                if not p.is_meta and not (p is embed and head is not embed))  # fmt: skip
    for module in model.modules():
        packed = getattr(module, "packed_copy", None)
        if getattr(module, "weight_released", False) and packed is not None:
            total += packed.numel() * packed.element_size()
    return total
