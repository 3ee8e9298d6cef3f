"""GPU-readiness of the forward's fused elementwise kernels without a GPU: RMSNorm (with and without the residual
add), SiLU-mul and rope + paged K/V write compile for sm_80 and sm_90 with the launchers' own block sizes and warp
counts, at the shapes of the models the project names, in bf16 and fp32, with no spills. Argument types and
16-divisibility come from ``job_from_launch`` on meta tensors shaped like a real call."""

from __future__ import annotations

import torch
from gpu_compile import compile_reports, format_table, job_from_launch

from specdec.kernels.rms_norm import rms_norm_config
from specdec.kernels.rope_kv import COMPILE_OPTIONS as ROPE_OPTIONS
from specdec.kernels.silu_mul import _BLOCK as SILU_BLOCK

MODELS = {  # name: (hidden, intermediate, Hq, Hkv, D)
    "SmolLM2-135M": (576, 1536, 9, 3, 64),
    "Llama-3.2-1B": (2048, 8192, 32, 8, 64),
    "Llama-3.2-3B": (3072, 8192, 24, 8, 128),
    "Qwen2.5-1.5B": (1536, 8960, 12, 2, 128),
}
ARCHS = (80, 90)
TOKENS, NUM_SLOTS, MAX_POS = 40, 4096 * 16, 4096
META = torch.device("meta")


def _jobs(hidden, inter, hq, hkv, d, dtype, arch):
    x = torch.empty(TOKENS, hidden, dtype=dtype, device=META)
    block, warps = rms_norm_config(hidden)
    for has_residual in (False, True):
        args = dict(x_ptr=x, residual_ptr=x, weight_ptr=torch.empty(hidden, dtype=dtype, device=META), out_ptr=x,
                    hidden=hidden, x_row_stride=hidden, residual_row_stride=hidden if has_residual else 0, eps=1e-5)
        yield f"rms_norm{'+add' if has_residual else ''}", job_from_launch(
            "specdec.kernels.rms_norm", "_fused_add_rms_norm_kernel", args,
            {"HAS_RESIDUAL": has_residual, "BLOCK": block}, warps, 3, arch, ())
    gate_up = torch.empty(TOKENS, 2 * inter, dtype=dtype, device=META)
    args = dict(gate_up_ptr=gate_up, out_ptr=gate_up, inter=inter, gate_up_row_stride=2 * inter)
    yield "silu_mul", job_from_launch("specdec.kernels.silu_mul", "_silu_mul_kernel", args,
                                      {"BLOCK": min(SILU_BLOCK, 1 << (inter - 1).bit_length())}, 4, 3, arch, ())
    yield "rope_write_kv", _rope_job(_rope_args(hq, hkv, d, dtype), d, arch, ROPE_OPTIONS["enable_fp_fusion"])


def _rope_job(args, d, arch, enable_fp_fusion):
    return job_from_launch("specdec.kernels.rope_kv", "_rope_write_kv_kernel", args,
                           {"HEAD_DIM": d, "BLOCK_HALF": d // 2}, 1, 3, arch, (), enable_fp_fusion)


def _rope_args(hq, hkv, d, dtype):
    qkv = torch.empty(TOKENS, (hq + 2 * hkv) * d, dtype=dtype, device=META)
    index = torch.empty(TOKENS, dtype=torch.int64, device=META)
    table = torch.empty(MAX_POS, d, dtype=torch.float32, device=META)
    cache = torch.empty(NUM_SLOTS, hkv, d, dtype=dtype, device=META)
    return dict(qkv_ptr=qkv, positions_ptr=index, cos_ptr=table, sin_ptr=table, slot_mapping_ptr=index,
                k_cache_ptr=cache, v_cache_ptr=cache, q_out_ptr=qkv, qkv_row_stride=qkv.shape[1], num_heads=hq,
                num_kv_heads=hkv)


def test_fused_forward_kernels_compile_without_spills():
    jobs, labels = [], []
    for model, shape in MODELS.items():
        for dtype in (torch.bfloat16, torch.float32):
            for arch in ARCHS:
                for op, job in _jobs(*shape, dtype, arch):
                    labels.append(f"{model} {str(dtype)[6:]} {op}")
                    jobs.append(job)
    reports = [dict(r, label=label) for label, r in zip(labels, compile_reports(jobs, workers=2), strict=True)]
    print("\n" + format_table(reports, ["label"]))
    for r in reports:
        where = f"{r['label']} sm_{r['arch']}"
        assert r["error"] is None, f"{where}:\n{r['error']}"
        assert r["spill_stores"] == 0 and r["spill_loads"] == 0, f"{where}: spills"
        assert r["shared"] <= 99 * 1024, f"{where}: {r['shared']} bytes of shared memory"


def test_rope_kernel_rounds_each_product_no_fma_in_its_ptx():
    """The rope kernel as launched compiles to PTX without a fused multiply-add in bf16 and fp16 for sm_90 (and fp16
    for sm_80) (an FMA skips the
    product's rounding to the model dtype: one ulp off torch in ~17% of elements on an H200); compiled with Triton's
    default FP fusion, the same kernel has FMAs - the mutant this check must catch."""
    jobs, labels = [], []
    # NOTE: not bf16 on sm_80, which has no bf16 multiply or add: the compiler narrows the exact fp32 products to
    # bf16 operations and emulates them as fma.rn.bf16 with 1 or -0 operands, one rounding per operation
    for dtype, arch in ((torch.bfloat16, 90), (torch.float16, 90), (torch.float16, 80)):
        args = _rope_args(4, 2, 64, dtype)
        for fusion in (ROPE_OPTIONS["enable_fp_fusion"], True):
            jobs.append(_rope_job(args, 64, arch, fusion))
            labels.append((str(dtype)[6:], arch, fusion))
    for (dtype, arch, fusion), r in zip(labels, compile_reports(jobs, workers=2), strict=True):
        assert r["error"] is None, f"{dtype} sm_{arch} fusion={fusion}:\n{r['error']}"
        if fusion:
            assert r["fma_count"] > 0, f"{dtype} sm_{arch}: the fusing compile has no FMA, the check cannot fail"
        else:
            assert r["fma_count"] == 0, f"{dtype} sm_{arch}: {r['fma_count']} FMAs in the shipped rope kernel"
