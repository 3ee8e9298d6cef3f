"""Per-call time of one linear layer, quantised or not, for 1..16 rows (a decode, k+1-row verification windows).

    python -m bench.costs.quant_linear [--shapes 8960x1536 1536x8960 151936x1536] [--rows 1 2 5 8 16] [--reps 15]

Shapes are ``N x K`` (out x in), Qwen2.5-1.5B's MLP up (gate_up is 2x), down and LM head by default. Paths (every
one built from the same random weight; the quantised ones through ``QuantizedLinear``, so the timed code is the
model's):
  fp32 F.linear, bf16 prepacked (oneDNN, ``specdec.model.linear.Linear``), int8 w8a8 (per-row int8 activations;
  bf16 input) by specdec's native kernel and by oneDNN's int8 GEMM, int8 torch ``_weight_int8pack_mm`` (weight-only,
  bf16), int4 g32 w4a8 (the C kernel of ``specdec/model/quant/native.py``: int4 weights x per-block int8
  activations, VNNI), int4 g32 int4pack (``_weight_int4pack_mm_for_cpu``, bf16); GGUF blocks as ``quantization=
  "gguf"`` holds them (Q4_K: w4a8 with fp32 scales; Q6_K / Q5_0: w8g in groups of 16 / 32); the batch-invariant bf16
  GEMM (kernels/cpu/gemm.py, the default bf16 path where it builds).
Each repetition times every (rows, path) once, interleaved, so a noisy neighbour hits all paths alike, and writes a
64 MiB buffer before every call so the weight comes from memory, not from the last-level cache, as it does in a
model's forward (a model's linears together are far larger than the cache). NOTE: without that flush a 14 MB int8
weight timed right after itself partly stays in cache and ran up to ~4x faster here. The table gives min and median
microseconds per call and the thread count.
"""

from __future__ import annotations

import argparse
import sys
import time

import torch

from bench.common import add_record_flag, machine_info, median, print_table, set_threads, write_json
from specdec.kernels.cpu import gemm
from specdec.model.linear import Linear
from specdec.model.quant import native
from specdec.model.quant.formats import quantize_int4
from specdec.model.quant.linear import QuantizedLinear


def _paths(n: int, k: int) -> dict[str, tuple]:
    """name -> (callable of x, input dtype)."""
    w = torch.randn(n, k) * 0.02
    paths = {"fp32 F.linear": (lambda x, w=w: torch.nn.functional.linear(x, w), torch.float32)}
    lin = Linear(k, n, bias=False).to(torch.bfloat16)
    with torch.no_grad():
        lin.weight.copy_(w)
    lin.prepack(release_weight=True)
    paths["bf16 prepacked"] = (lin, torch.bfloat16)
    for cpu_path in ("auto", "torch"):
        q8 = QuantizedLinear.from_weight(w, None, "int8")
        q8.prepare(torch.device("cpu"), cpu_path, release=False)
        if q8.path == "w8a8":
            paths[f"int8 w8a8 ({q8.backend})"] = (q8, torch.bfloat16)
    w8, s8 = q8.qweight, q8.scale.reshape(n).to(torch.bfloat16)
    paths["int8 _weight_int8pack_mm"] = (lambda x: torch._weight_int8pack_mm(x, w8, s8), torch.bfloat16)
    for cpu_path in ("auto", "torch"):
        q4 = QuantizedLinear.from_weight(w, None, "int4", 32)
        q4.prepare(torch.device("cpu"), cpu_path)
        if q4.path in ("w4a8", "int4pack"):
            paths[f"int4 g32 {q4.path}"] = (q4, torch.bfloat16)
    paths.update(_kept_gguf_paths(w))
    if gemm.available():  # the batch-invariant bf16 GEMM (the default bf16 path where it is built)
        packed = gemm.pack_bf16(w.to(torch.bfloat16))
        paths[f"bf16 invariant ({gemm.backend()})"] = (lambda x, p=packed: gemm.gemm_bf16(x, p, n), torch.bfloat16)
    del w
    return paths


def _kept_gguf_paths(w: torch.Tensor) -> dict[str, tuple]:
    """GGUF blocks as ``quantization="gguf"`` holds them (random values of each type's form): Q4_K as int4 g32
    with fp32 scale d * sc and offset -(dmin * m) (w4a8, fp32 scales), Q6_K as int8 g16 and Q5_0 / Q8_0 as int8 g32
    with fp32 scales (w8g)."""
    n, k = w.shape
    if not native.available():
        return {}
    q4, _, _ = quantize_int4(w, 32)
    d = torch.rand(n, k // 256).repeat_interleave(8, 1).half().float() * 1e-3 + 1e-5  # one d per 256, as Q4_K
    sc, mins = torch.randint(1, 64, (n, k // 32)).float(), torch.randint(0, 64, (n, k // 32)).float()
    q4k = QuantizedLinear(q4, d * sc, -(d * mins), 4, exact_scales=True)
    q4k.prepare(torch.device("cpu"))
    paths = {"Q4_K as stored (w4a8 fp32 scales)": (q4k, torch.bfloat16)}
    for name, group, lo in (("Q6_K", 16, -32), ("Q5_0", 32, -16)):
        q = torch.randint(lo, -lo, (n, k), dtype=torch.int8)
        lin = QuantizedLinear(q, torch.rand(n, k // group) * 1e-3 + 1e-5, None, 8, exact_scales=True)
        lin.prepare(torch.device("cpu"))
        paths[f"{name} as stored (w8g g{group})"] = (lin, torch.bfloat16)
    return paths


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.costs.quant_linear", description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", nargs="+", default=["8960x1536", "1536x8960", "151936x1536"])
    parser.add_argument("--rows", nargs="+", type=int, default=[1, 2, 5, 8, 16])
    parser.add_argument("--reps", type=int, default=15)
    parser.add_argument("--threads", type=int, default=1)
    add_record_flag(parser)
    args = parser.parse_args(argv)
    set_threads(args.threads)
    torch.manual_seed(0)
    results = []
    for shape in args.shapes:
        n, k = (int(s) for s in shape.split("x"))
        paths = _paths(n, k)
        inputs = {(name, m): torch.randn(m, k).to(dtype) for name, (_, dtype) in paths.items() for m in args.rows}
        times: dict[tuple[str, int], list[float]] = {key: [] for key in inputs}
        reps = args.reps if n * k < 50_000_000 else max(3, args.reps // 3)
        flush = torch.empty(64 * 2**20, dtype=torch.uint8)
        with torch.inference_mode():
            for rep in range(reps + 1):  # the first repetition warms up and is dropped
                for m in args.rows:
                    for name, (fn, _) in paths.items():
                        x = inputs[(name, m)]
                        flush.add_(1)  # evict the weight from the cache
                        start = time.perf_counter()
                        fn(x)
                        if rep:
                            times[(name, m)].append((time.perf_counter() - start) * 1e6)
        rows = []
        for name in paths:
            row = [shape, name]
            for m in args.rows:
                ts = times[(name, m)]
                row.append(f"{min(ts):.0f} / {median(ts):.0f}")
                results.append({"shape": shape, "path": name, "rows": m, "min_us": min(ts), "median_us": median(ts),
                                "reps": len(ts)})
            rows.append(row)
        print_table(rows, ["N x K", "path (us min / median)", *[f"{m} rows" for m in args.rows]])
        print(flush=True)
        del paths, inputs
    write_json("quant_linear", {"meta": {**machine_info(), "threads": args.threads, "reps": args.reps},
                                "results": results}, args.record)
    return 0


if __name__ == "__main__":
    sys.exit(main())
