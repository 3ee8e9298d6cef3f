"""GPU-readiness of the weight-only quantised matmul without a GPU: int8 (per channel, per group of 32) and int4
(group 32 / 128) launches for Qwen2.5-1.5B's shapes compile for sm_80 and sm_90, bf16 and fp16 activations, without
spills and within shared memory. Argument types and 16-divisibility come from ``job_from_launch`` on meta tensors."""

from __future__ import annotations

import torch
from gpu_compile import compile_reports, format_table, job_from_launch

from specdec.kernels.quant_matmul import quant_matmul_launch

SHAPES = {"mlp up": (8960, 1536), "mlp down": (1536, 8960)}
SCHEMES = {"int8 per-channel": (8, 1), "int8 g32": (8, 32), "int4 g32": (4, 32), "int4 g128": (4, 128)}
DTYPES = {"mlp up": (torch.bfloat16, torch.float16), "mlp down": (torch.bfloat16,)}
ARCHS = (80, 90)


def _launch(n, k, bits, group, dtype):
    meta = torch.device("meta")
    x = torch.empty(16, k, dtype=dtype, device=meta)
    qweight = torch.empty(n, k if bits == 8 else k // 2, dtype=torch.int8 if bits == 8 else torch.uint8, device=meta)
    groups = 1 if group == 1 else k // group
    scale = torch.empty(n, groups, dtype=torch.float32, device=meta)
    offset = scale if bits == 4 else None
    out = torch.empty(16, n, dtype=dtype, device=meta)
    return quant_matmul_launch(x, qweight, scale, offset, None, out, bits)


def test_quant_matmul_compiles_without_spills():
    jobs, labels = [], []
    for shape_name, (n, k) in SHAPES.items():
        for scheme, (bits, group) in SCHEMES.items():
            for dtype in DTYPES[shape_name]:
                _, args, constexprs, num_warps = _launch(n, k, bits, group, dtype)
                for arch in ARCHS:
                    labels.append(f"{shape_name} {scheme} {str(dtype)[6:]}")
                    jobs.append(job_from_launch("specdec.kernels.quant_matmul", "_quant_matmul_kernel", args,
                                                constexprs, num_warps, 3, arch))
    reports = [dict(r, label=label) for label, r in zip(labels, compile_reports(jobs, workers=2), strict=True)]
    print("\n" + format_table(reports, ["label", "BITS", "GROUP"]))
    for r in reports:
        where = f"{r['label']} sm_{r['arch']}"
        assert r["error"] is None, f"{where}:\n{r['error']}"
        assert r["spill_stores"] == 0 and r["spill_loads"] == 0, f"{where}: spills"
        assert r["shared"] <= 99 * 1024, f"{where}: {r['shared']} bytes of shared memory"
