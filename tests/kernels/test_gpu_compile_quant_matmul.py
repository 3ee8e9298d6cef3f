"""GPU-readiness of the weight-only quantised matmul without a GPU: the launches of Llama-3.2-3B's linears (a split-K
qkv, the unsplit LM head) for int8 per channel / per group of 32 and int4 per group of 32 / 128, bf16 / fp16 / fp32
activations, compile for sm_80 and sm_90 without spills and within shared memory - the main kernel with the
configuration ``quant_matmul_config`` picks for an H100 / H200 (132 SMs), and the split-K reduction. Argument types
and 16-divisibility come from ``job_from_launch`` on meta tensors."""

from __future__ import annotations

import torch
from gpu_compile import compile_reports, format_table, job_from_launch

from specdec.kernels.quant_matmul import quant_matmul_launch

SHAPES = {"qkv": (5120, 3072), "lm_head": (128256, 3072)}  # split K (4 splits on 132 SMs) / one split
SCHEMES = {"int8 per-channel": (8, 1), "int8 g32": (8, 32), "int4 g32": (4, 32), "int4 g128": (4, 128)}
DTYPES = {"qkv": (torch.bfloat16, torch.float16, torch.float32), "lm_head": (torch.bfloat16,)}
ARCHS = (80, 90)
MODULE = "specdec.kernels.quant_matmul"


def _plan(n, k, bits, group, dtype):
    meta = torch.device("meta")
    x = torch.empty(16, k, dtype=dtype, device=meta)
    qweight = torch.empty(n, k if bits == 8 else k // 2, dtype=torch.int8 if bits == 8 else torch.uint8, device=meta)
    groups = 1 if group == 1 else k // group
    scale = torch.empty(n, groups, dtype=torch.float32, device=meta)
    offset = scale if bits == 4 else None
    out = torch.empty(16, n, dtype=dtype, device=meta)
    return quant_matmul_launch(x, qweight, scale, offset, out[0], out, bits, num_sms=132, interpret=False)


def test_quant_matmul_compiles_without_spills():
    jobs, labels = [], []
    for shape_name, (n, k) in SHAPES.items():
        for scheme, (bits, group) in SCHEMES.items():
            for dtype in DTYPES[shape_name]:
                plan = _plan(n, k, bits, group, dtype)
                name = f"{shape_name} {scheme} {str(dtype)[6:]} split {plan.grid[1]}"
                for arch in ARCHS:
                    labels.append(name)
                    jobs.append(job_from_launch(MODULE, "_quant_matmul_kernel", plan.args, plan.constexprs,
                                                plan.num_warps, plan.num_stages, arch))
                    if plan.reduce_grid is not None:
                        labels.append(f"{name} (reduce)")
                        jobs.append(job_from_launch(MODULE, "_split_k_reduce_kernel", plan.reduce_args,
                                                    plan.reduce_constexprs, 4, 1, arch))
    reports = [dict(r, label=label) for label, r in zip(labels, compile_reports(jobs, workers=2), strict=True)]
    print("\n" + format_table(reports, ["label", "STEP", "SUB", "TILES"]))
    for r in reports:
        where = f"{r['label']} sm_{r['arch']}"
        assert r["error"] is None, f"{where}:\n{r['error']}"
        assert r["spill_stores"] == 0 and r["spill_loads"] == 0, f"{where}: spills"
        assert r["shared"] <= 99 * 1024, f"{where}: {r['shared']} bytes of shared memory"
