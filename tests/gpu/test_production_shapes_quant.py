"""Production-shape correctness of the weight-only quantised matmul on CUDA (kernels/quant_matmul.py): the compiled
kernel against its torch reference ON THE GPU, at the linears of Llama-3.2-1B and 3B (fused qkv, o, fused gate/up,
down, LM head) with 1 / 5 / 16 rows (a decode, a k = 4 verification window, a batch), int8 per channel and int4
per group of 32 (the defaults), bf16 activations (fp16 / fp32 on two linears), with the configuration the launcher
picks for this GPU (split K on the narrow linears, one split on the LM head) - plus row independence: each row of a
5- or 16-row call is bit-identical to the same row computed alone.

Marked ``gpu`` like tests/gpu/test_production_shapes.py: run with ``python -m pytest -m gpu tests/gpu``; without CUDA
every test FAILS ("needs CUDA", tests/gpu/conftest.py).

Tolerance: one rounding of the output dtype (rtol 2^-7 bf16, 2^-10 fp16, 1e-5 fp32) plus 1e-4 of the largest output
(fp32 sums over K up to 8192 in a different order and grouping than the reference's).
"""

from __future__ import annotations

import functools

import pytest
import torch

from specdec.kernels.quant_matmul import quant_matmul, quant_matmul_config, quant_matmul_reference
from specdec.model.quant.linear import QuantizedLinear

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("no_tf32")]  # the reference's fp32 matmul: no tf32

# (hidden, heads, kv heads, intermediate, vocab) -> name: (N out, K in), as the engine fuses them
MODELS = {"llama1b": (2048, 32, 8, 8192, 128256), "llama3b": (3072, 24, 8, 8192, 128256)}


def _linears(hidden, heads, kv_heads, inter, vocab):
    head_dim = hidden // heads
    return {"qkv": ((heads + 2 * kv_heads) * head_dim, hidden), "o": (hidden, hidden), "gate_up": (2 * inter, hidden),
            "down": (hidden, inter), "lm_head": (vocab, hidden)}  # fmt: skip


SHAPES = {f"{model}_{name}": nk for model, cfg in MODELS.items() for name, nk in _linears(*cfg).items()}
RTOL = {torch.bfloat16: 2**-7, torch.float16: 2**-10, torch.float32: 1e-5}


@functools.cache
def _module(shape: str, scheme: str) -> QuantizedLinear:
    n, k = SHAPES[shape]
    gen = torch.Generator(device="cuda").manual_seed(n * 7 + k)
    w = torch.randn(n, k, generator=gen, device="cuda") * 0.02  # (N, K) fp32
    return QuantizedLinear.from_weight(w, None, scheme)


def check(shape: str, scheme: str, dtype: torch.dtype) -> None:
    m = _module(shape, scheme)
    n, k = SHAPES[shape]
    args = (m.qweight, m.scale, m.offset, None, m.bits)
    gen = torch.Generator(device="cuda").manual_seed(k)
    x = torch.randn(16, k, generator=gen, device="cuda").to(dtype)  # (16, K)
    alone = torch.cat([quant_matmul(x[i : i + 1], *args) for i in range(16)])  # (16, N): 16 decodes
    ref = quant_matmul_reference(x, *args)  # (16, N)
    cfg = quant_matmul_config(n, k, m.bits, m.group_size, torch.cuda.get_device_properties(0).multi_processor_count,
                              dtype == torch.float32)  # fmt: skip
    where = f"{shape} {scheme} {dtype} split {cfg.split}"
    for rows in (1, 5, 16):
        out = quant_matmul(x[:rows], *args)
        assert out.dtype == dtype
        atol = 1e-4 * float(ref[:rows].float().abs().max())
        torch.testing.assert_close(out.float(), ref[:rows].float(), rtol=RTOL[dtype], atol=atol,
                                   msg=lambda msg, rows=rows: f"{where} rows {rows}: {msg}")  # fmt: skip
        assert torch.equal(out, alone[:rows]), f"{where}: rows {rows} differ from the same rows computed alone"


@pytest.mark.parametrize("scheme", ["int8", "int4"])
@pytest.mark.parametrize("shape", list(SHAPES))
def test_quant_matmul_bf16(shape, scheme):
    check(shape, scheme, torch.bfloat16)


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32], ids=str)
@pytest.mark.parametrize("scheme", ["int8", "int4"])
@pytest.mark.parametrize("shape", ["llama3b_qkv", "llama3b_down"])
def test_quant_matmul_fp16_fp32(shape, scheme, dtype):
    check(shape, scheme, dtype)


def test_quant_matmul_int8_group32_and_bias():
    """Group-wise int8 (GGUF Q8_0's layout) and a bias through the split-K reduction, at the 3B qkv."""
    n, k = SHAPES["llama3b_qkv"]
    gen = torch.Generator(device="cuda").manual_seed(1)
    w = torch.randn(n, k, generator=gen, device="cuda") * 0.02  # (N, K)
    bias = torch.randn(n, generator=gen, device="cuda").to(torch.bfloat16)  # (N,)
    m = QuantizedLinear.from_weight(w, bias, "int8", 32)
    x = torch.randn(5, k, generator=gen, device="cuda").to(torch.bfloat16)  # (5, K)
    args = (m.qweight, m.scale, m.offset, m.bias.detach(), m.bits)
    out, ref = quant_matmul(x, *args), quant_matmul_reference(x, *args)
    torch.testing.assert_close(out.float(), ref.float(), rtol=2**-7, atol=1e-4 * float(ref.float().abs().max()))
    assert torch.equal(out[2:3], quant_matmul(x[2:3], *args))
