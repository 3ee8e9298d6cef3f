"""The weight-only quantised matmul kernel (kernels/quant_matmul.py) under the Triton interpreter against its torch
reference: int8 per channel / per group, int4 per group with offsets (groups a power of two, not one, and larger
than a loop step), bias or not, fp32 / bf16 / fp16 inputs, 1..17 rows (17: a second row block), N not a multiple of
the 64-column tile, split K with a shorter last split; rows independent of their batch; the configuration a
function of the weight's shape only; argument validation.

Tolerances: fp32 1e-5 (the kernel applies the scale after the dot and the offset as ``offset * row sum``, the
reference dequantises first: fp32 rounding, ~1e-7 relative); bf16 / fp16: one rounding of the output dtype
(``rtol`` = its relative step 2^-7 / 2^-10) plus 1e-5 absolute - the kernel and the reference round the same fp32
value up to ~1e-7, so at most one step apart. A scale taken from the neighbouring group, or an offset left out, is
far outside that (``test_tolerance_catches_wrong_scales_and_offsets``)."""

from __future__ import annotations

import inspect

import pytest
import torch

from specdec import ops
from specdec.kernels.quant_matmul import QuantConfig, quant_matmul, quant_matmul_config, quant_matmul_reference
from specdec.model.quant.linear import QuantizedLinear

CASES = [  # (N, K, scheme, group): per channel with K not a multiple of the step; groups 32 / 64 (a power of two),
    # 48 (padded sub-tiles), 192 (cut into two sub-tiles of 96)
    (48, 96, "int8", None), (100, 96, "int8", 32), (40, 384, "int8", 192), (72, 64, "int4", 32),
    (130, 128, "int4", 64), (72, 96, "int4", 48),
]
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
TOL = {torch.float32: (1e-5, 1e-5), torch.bfloat16: (2**-7, 1e-5), torch.float16: (2**-10, 1e-5)}  # (rtol, atol)


def _module(n, k, scheme, group, bias=True, seed=0):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g) * 0.1  # (N, K)
    b = torch.randn(n, generator=g) if bias else None  # (N,)
    return QuantizedLinear.from_weight(w, b, scheme, group)


def _args(m: QuantizedLinear, dtype=torch.float32):
    bias = None if m.bias is None else m.bias.detach().to(dtype)
    return m.qweight, m.scale, m.offset, bias, m.bits


def _check(out, ref, dtype):
    assert out.dtype == ref.dtype == dtype
    rtol, atol = TOL[dtype]
    torch.testing.assert_close(out.float(), ref.float(), rtol=rtol, atol=atol)


@pytest.mark.parametrize("n,k,scheme,group", CASES)
@pytest.mark.parametrize("rows", [1, 5, 16, 17])
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_kernel_matches_reference(n, k, scheme, group, rows, bias, dtype):
    m = _module(n, k, scheme, group, bias)
    x = torch.randn(rows, k).to(dtype)  # (M, K)
    _check(quant_matmul(x, *_args(m, dtype)), quant_matmul_reference(x, *_args(m, dtype)), dtype)


# Split K forced on small shapes: (N, K, scheme, group, config). K = 320 in 64-column iterations is 5 iterations in
# splits of 2, 2, 1; per channel, K = 200 in 32-column iterations is 7 in splits of 3, 3, 1 (the last one partial).
SPLIT_CASES = [
    (100, 320, "int8", 32, QuantConfig(32, 32, 2, 3, 128, 4, 3)),
    (70, 200, "int8", None, QuantConfig(32, 32, 1, 3, 96, 4, 3)),
    (72, 320, "int4", 32, QuantConfig(32, 32, 2, 3, 128, 4, 3)),
    (72, 384, "int4", 128, QuantConfig(64, 64, 1, 4, 128, 4, 3)),  # two sub-tiles per group, two groups per split
]


@pytest.mark.parametrize("n,k,scheme,group,config", SPLIT_CASES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_split_k_matches_reference(n, k, scheme, group, config, dtype):
    m = _module(n, k, scheme, group)
    x = torch.randn(7, k).to(dtype)  # (M, K)
    _check(quant_matmul(x, *_args(m, dtype), config=config), quant_matmul_reference(x, *_args(m, dtype)), dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("case", [0, 2], ids=["int8_split", "int4_split"])
def test_kernel_rows_are_independent(case, dtype):
    """A row's output is bit-identical alone (decode), in a 5-row window, in 16 rows and in 17 (two row blocks)."""
    n, k, scheme, group, config = SPLIT_CASES[case]
    m = _module(n, k, scheme, group)
    x = torch.randn(17, k).to(dtype)  # (M, K)
    for cfg in (config, None):  # forced split K, and the shape's own configuration
        alone = torch.cat([quant_matmul(x[i : i + 1], *_args(m, dtype), config=cfg) for i in range(17)])
        for rows in (5, 16, 17):
            assert torch.equal(quant_matmul(x[:rows], *_args(m, dtype), config=cfg), alone[:rows])


def test_config_depends_on_the_weight_only():
    """No M anywhere in the configuration: same tiles and splits for a decode and a verification window."""
    assert "m" not in inspect.signature(quant_matmul_config).parameters
    # Llama-3.2-3B qkv on 132 SMs: 80 column tiles alone would leave SMs idle, so K is split (>= 2 programs per SM)
    for bits, group in ((8, 3072), (8, 32), (4, 32), (4, 128)):
        cfg = quant_matmul_config(5120, 3072, bits, group, 132)
        assert cfg.split > 1 and 80 * cfg.split >= 2 * 132, cfg
        assert cfg.k_per_split % (cfg.tiles * cfg.step) == 0 and (cfg.split - 1) * cfg.k_per_split < 3072, cfg
    assert quant_matmul_config(128256, 3072, 4, 32, 132).split == 1  # the LM head has 2004 column tiles


def test_tolerance_catches_wrong_scales_and_offsets():
    """Mutants of the kernel's arithmetic, computed with the reference: each is outside the tests' tolerance."""
    m = _module(72, 128, "int4", 32)
    for dtype in DTYPES:
        x = torch.randn(5, 128).to(dtype)
        out = quant_matmul(x, *_args(m, dtype))
        q, scale, offset, bias, bits = _args(m, dtype)
        mutants = {"scale of the next group": (q, scale.roll(1, 1), offset), "no offset": (q, scale, None),
                   "offset of the next group": (q, scale, offset.roll(1, 1))}  # fmt: skip
        for name, (q_, s_, o_) in mutants.items():
            with pytest.raises(AssertionError):
                _check(out, quant_matmul_reference(x, q_, s_, o_, bias, bits), dtype)
            print(f"{dtype} {name}: caught")


def test_module_dispatches_to_the_kernel_when_forced():
    m = _module(48, 64, "int8", 32)
    m.prepare(torch.device("cpu"), "weight_only")  # the weight-only path (grouped int8 runs w8g on VNNI CPUs)
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
    with pytest.raises(ValueError, match="config"):  # a sub-tile straddling two groups
        quant_matmul(torch.randn(2, 64), m.qweight, m.scale, m.offset, None, 4, config=QuantConfig(64, 64, 1, 1, 64,
                                                                                                    4, 3))
