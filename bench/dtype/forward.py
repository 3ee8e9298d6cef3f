"""Cost of one whole forward, fp32 vs bf16 unpacked vs bf16 packed: a decode step and a verification window.

    python -m bench.dtype.forward [--target smollm2] [--batch 1 4] [--new-tokens 1 5] [--context 200] [--reps 3]

The same checkpoint is loaded twice, in float32 (with its prepacked linears where supported: ``F.linear`` below
4 rows, the packed copy from 4 up) and in bfloat16 without packing. Three variants are timed:

  fp32            the float32 model as the engine loads it
  bf16            the bfloat16 model with no packed copies (every linear runs bf16 ``F.linear``: bf16 "before")
  bf16packed_all  the same bfloat16 model with every linear prepacked, used from one row up (bf16 "now")

For every batch size and number of new tokens per sequence (1 = a decode step, k+1 = a verification window),
each sequence holding ``--context`` cached tokens, ``bench.common.forward_seconds`` runs the engine's
``ModelRunner`` forward on a scratch KV pool: one warm-up, then the median of ``--inner`` forwards. Its clock is
switched to process CPU time (``time.process_time``) for this benchmark, so load from other jobs does not
inflate the figures the way it would wall time. That is repeated ``--reps`` times, cases and variants
interleaved within each repetition; the minimum and the median over repetitions are reported. One torch thread
by default. Results: ``bench/out/dtype_forward_<target>_t<threads>.json`` (``--record``: ``bench/results/``).
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import torch

import bench.common
from bench.common import (
    add_record_flag,
    forward_seconds,
    machine_info,
    print_table,
    resolve_model,
    set_threads,
    slug,
    write_json,
)
from specdec.checkpoint.loader import load_model
from specdec.model.config import ModelConfig
from specdec.model.linear import Linear

VARIANTS = ("fp32", "bf16", "bf16packed_all")
MAX_POSITIONS = 2048


@contextlib.contextmanager
def cpu_clock() -> Iterator[None]:
    """While open, ``bench.common.timed`` (the clock of ``forward_seconds``) measures process CPU time."""
    def timed_cpu(fn: Callable[[], object]) -> tuple[float, object]:
        start = time.process_time()
        result = fn()
        return time.process_time() - start, result

    original = bench.common.timed
    bench.common.timed = timed_cpu
    try:
        yield
    finally:
        bench.common.timed = original


def set_bf16_packing(model: torch.nn.Module, on: bool) -> None:
    """Prepack every linear of the bfloat16 ``model`` (used from one row up), or drop the packed copies."""
    for module in model.modules():
        if isinstance(module, Linear):
            module.prepack() if on else module.unpack()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.dtype.forward", description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", default="smollm2", help="model folder, or smollm2 | qwen-0.5b | qwen-1.5b")
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 4], help="sequences per forward")
    parser.add_argument("--new-tokens", type=int, nargs="+", default=[1, 5],
                        help="new tokens per sequence (1 = decode step, k+1 = verification window)")
    parser.add_argument("--context", type=int, default=200, help="tokens already cached per sequence")
    parser.add_argument("--reps", type=int, default=3, help="interleaved repetitions (min and median reported)")
    parser.add_argument("--inner", type=int, default=5, help="forwards per measurement (their median is one sample)")
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    add_record_flag(parser)
    args = parser.parse_args(argv)
    set_threads(args.threads)
    path = resolve_model(args.target)
    config = ModelConfig.from_json(path)
    cpu = torch.device("cpu")
    m32 = load_model(path, torch.float32, cpu, MAX_POSITIONS, config)
    m16 = load_model(path, torch.bfloat16, cpu, MAX_POSITIONS, config, prepack_weights=False)
    fp32_packed = m32.lm_head.packed_weight is not None
    print(f"threads {torch.get_num_threads()}, torch {torch.__version__}, fp32 packed {fp32_packed}", flush=True)
    variants = {"fp32": (m32, None), "bf16": (m16, False), "bf16packed_all": (m16, True)}
    cases = [(b, n) for b in args.batch for n in args.new_tokens]
    samples: dict[tuple[int, int, str], list[float]] = {(b, n, v): [] for b, n in cases for v in VARIANTS}
    with cpu_clock():
        for _ in range(args.reps):
            for b, n in cases:
                for name, (model, packed) in variants.items():
                    if packed is not None:
                        set_bf16_packing(model, packed)
                    samples[b, n, name].append(forward_seconds(model, config, b, args.context, n, reps=args.inner))
    rows, results = [], []
    for (b, n, name), secs in samples.items():
        low, mid = 1e3 * min(secs), 1e3 * statistics.median(secs)
        decode = samples[b, 1, name] if (b, 1, name) in samples else None
        vs_decode = statistics.median(secs) / statistics.median(decode) if decode else None
        results.append({"batch": b, "new_tokens": n, "variant": name, "min_ms": low, "median_ms": mid,
                        "vs_decode": vs_decode, "samples_ms": [1e3 * s for s in secs]})
        rows.append([b, n, name, f"{low:.1f}", f"{mid:.1f}", None if vs_decode is None else f"{vs_decode:.2f}x"])
    print_table(rows, ["batch", "new", "variant", "min ms", "median ms", "median / decode"])
    path_out = write_json(f"dtype_forward_{slug(Path(args.target).name)}_t{args.threads}",
                          {"machine": machine_info(), "target": args.target, "threads": torch.get_num_threads(),
                           "context": args.context, "reps": args.reps, "inner": args.inner, "clock": "process_time",
                           "fp32_packed": fp32_packed, "results": results}, record=args.record)
    print(f"wrote {path_out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
