"""The CUDA batch-invariant GEMM (``specdec.kernels.matmul_invariant``, issue 33) without a GPU: in the interpreter
it is the product (fp32 reference within rounding) and a row's output does not depend on the other rows of the call
(a decode, a window, a batch, a prefill chunk); its launch plan is the same for every row count but for the grid's
row dimension (what makes a GPU's rows invariant: the same binary, the same K order, no split-K); it compiles for
sm_80 / sm_90 without spills at the named models' shapes."""

from __future__ import annotations

import pytest
import torch
from gpu_compile import compile_reports, format_table, job_from_launch

from specdec.kernels.matmul_invariant import matmul_invariant, matmul_invariant_reference, matmul_plan

TOL = {torch.float32: (1e-5, 1e-5), torch.float16: (1e-3, 2.0**-10), torch.bfloat16: (1e-2, 2.0**-7)}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_it_is_the_product_and_rows_do_not_depend_on_the_call(dtype):
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(70, 100, generator=gen).to(dtype)  # N and K not multiples of the tiles
    bias = torch.randn(70, generator=gen).to(dtype)
    x = torch.randn(37, 100, generator=gen).to(dtype)
    y = matmul_invariant(x, w, bias)
    atol, rtol = TOL[dtype]
    scale = (x.float().abs() @ w.float().abs().T).amax().item()
    torch.testing.assert_close(y.float(), matmul_invariant_reference(x, w, bias).float(), atol=atol * scale,
                               rtol=rtol)
    for rows in (slice(0, 1), slice(5, 6), slice(3, 8), slice(0, 17), slice(20, 37)):  # decodes, windows, batches
        assert torch.equal(matmul_invariant(x[rows], w, bias), y[rows]), rows


def test_the_launch_plan_does_not_depend_on_the_row_count():
    plans = [matmul_plan(m, 4096, dtype) for m in (1, 2, 5, 16, 17, 40, 64, 512, 4096)
             for dtype in (torch.bfloat16,)]
    first = plans[0]
    for plan in plans:
        assert plan["constexprs"] == first["constexprs"]
        assert (plan["num_warps"], plan["num_stages"]) == (first["num_warps"], first["num_stages"])
        assert plan["grid"][1] == first["grid"][1]


def test_bad_inputs():
    with pytest.raises(ValueError, match="share a dtype"):
        matmul_invariant(torch.zeros(2, 8), torch.zeros(4, 8, dtype=torch.float16))
    with pytest.raises(ValueError, match=r"\[M, K\]"):
        matmul_invariant(torch.zeros(2, 8), torch.zeros(4, 9))
    assert matmul_invariant(torch.zeros(0, 8), torch.zeros(4, 8)).shape == (0, 4)


SHAPES = {"Llama-3.2-1B qkv": (3072, 2048), "Llama-3.2-3B down": (3072, 8192), "Qwen2.5-1.5B head": (151936, 1536)}


def test_it_compiles_for_sm80_and_sm90_without_spills():
    jobs, labels = [], []
    meta = torch.device("meta")
    for name, (n, k) in SHAPES.items():
        for dtype in (torch.bfloat16, torch.float32):
            plan = matmul_plan(40, n, dtype, interpret=False)
            x = torch.empty(40, k, dtype=dtype, device=meta)
            w = torch.empty(n, k, dtype=dtype, device=meta)
            args = dict(x_ptr=x, w_ptr=w, bias_ptr=x, out_ptr=torch.empty(40, n, dtype=dtype, device=meta),
                        m_rows=40, n_cols=n, k_dim=k, stride_xm=k, stride_wn=k)
            for arch in (80, 90):
                labels.append(f"{name} {str(dtype)[6:]}")
                jobs.append(job_from_launch("specdec.kernels.matmul_invariant", "_matmul_kernel", args,
                                            {"HAS_BIAS": False, **plan["constexprs"]}, plan["num_warps"],
                                            plan["num_stages"], arch, ("m_rows",)))
    reports = [dict(r, label=label) for label, r in zip(labels, compile_reports(jobs, workers=2), strict=True)]
    print("\n" + format_table(reports, ["label"]))
    for r in reports:
        where = f"{r['label']} sm_{r['arch']}"
        assert r["error"] is None, f"{where}:\n{r['error']}"
        assert r["spill_stores"] == 0 and r["spill_loads"] == 0, f"{where}: spills"
        assert r["shared"] <= 99 * 1024, f"{where}: {r['shared']} bytes of shared memory"
