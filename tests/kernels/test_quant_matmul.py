"""The weight-only quantised matmul kernel (kernels/quant_matmul.py) under the Triton interpreter against its torch
reference: int8 per-channel / per-group, int4 per-group with offsets, bias or not, fp32 / bf16 inputs, 1..17 rows
(17: a second row block); rows independent of their batch; argument validation."""

from __future__ import annotations

import pytest
import torch

from specdec import ops
from specdec.kernels.quant_matmul import quant_matmul, quant_matmul_reference
from specdec.model.quant.linear import QuantizedLinear

CASES = [  # (N, K, scheme, group)
    (48, 64, "int8", None), (100, 96, "int8", 32), (72, 64, "int4", 32), (130, 128, "int4", 64),
]


def _module(n, k, scheme, group, bias=True, seed=0):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g) * 0.1
    b = torch.randn(n, generator=g) if bias else None
    return QuantizedLinear.from_weight(w, b, scheme, group)


def _args(m: QuantizedLinear):
    return m.qweight, m.scale, m.offset, m.bias, m.bits


@pytest.mark.parametrize("n,k,scheme,group", CASES)
@pytest.mark.parametrize("rows", [1, 5, 17])
@pytest.mark.parametrize("bias", [True, False])
def test_kernel_matches_reference_fp32(n, k, scheme, group, rows, bias):
    m = _module(n, k, scheme, group, bias)
    x = torch.randn(rows, k)
    torch.testing.assert_close(quant_matmul(x, *_args(m)), quant_matmul_reference(x, *_args(m)), rtol=1e-5,
                               atol=1e-5)


@pytest.mark.parametrize("scheme,group", [("int8", None), ("int4", 32)])
def test_kernel_bf16_input(scheme, group):
    m = _module(64, 64, scheme, group)
    m.bias = torch.nn.Parameter(m.bias.to(torch.bfloat16), requires_grad=False)
    x = torch.randn(3, 64).to(torch.bfloat16)
    out = quant_matmul(x, *_args(m))
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out, quant_matmul_reference(x, *_args(m)), rtol=1e-2, atol=1e-2)


def test_kernel_rows_are_independent():
    m = _module(72, 64, "int4", 32)
    x = torch.randn(16, 64)
    alone = torch.cat([quant_matmul(x[i:i + 1], *_args(m)) for i in range(16)])
    assert torch.equal(quant_matmul(x, *_args(m)), alone)


def test_module_dispatches_to_the_kernel_when_forced():
    m = _module(48, 64, "int8", 32)
    m.prepare(torch.device("cpu"))  # group-wise int8: no CPU fast path, the weight-only path
    assert m.path == "weight_only"
    x = torch.randn(2, 64)
    with ops.force_triton():
        out = m(x)
    torch.testing.assert_close(out, quant_matmul_reference(x, *_args(m)), rtol=1e-5, atol=1e-5)


def test_bad_arguments_are_refused():
    m = _module(48, 64, "int4", 32)
    with pytest.raises(ValueError, match="qweight"):
        quant_matmul(torch.randn(2, 64), m.qweight.to(torch.int8), m.scale, m.offset, None, 4)
    with pytest.raises(ValueError, match="row-contiguous"):
        quant_matmul(torch.randn(64, 2).T, m.qweight, m.scale, m.offset, None, 4)
    with pytest.raises(ValueError, match="offset"):
        quant_matmul(torch.randn(2, 64), m.qweight, m.scale, m.offset[:, :1].contiguous(), None, 4)
