"""The native paths that run GGUF blocks as stored: "w8g" (int8 in groups of 16 or of a multiple of 32, fp32
scales: Q8_0 / Q5_0 / Q6_K) and w4a8 with fp32 scales and offsets (``exact_scales``: Q4_K's ``d * sc`` and
``dmin * m``, which fp16 cannot hold). Each is held to its torch reference, its rows to independence, and a
planted bug is caught."""

from __future__ import annotations

import pytest
import torch

from specdec.model.quant import native
from specdec.model.quant.formats import quantize_int4, quantize_int8, unpack_int4
from specdec.model.quant.linear import QuantizedLinear, RowStack

pytestmark = pytest.mark.skipif(not native.available(), reason="no AVX-512 VNNI or no C compiler here")


def _int8_grouped(n: int, k: int, group: int, seed: int = 0, offsets: bool = False) -> QuantizedLinear:
    g = torch.Generator().manual_seed(seed)
    q = torch.randint(-128, 128, (n, k), dtype=torch.int8, generator=g)  # the full int8 range: Q8_0's
    scale = torch.rand(n, k // group, generator=g) * 1e-3 + 1e-5  # fp32 values fp16 does not hold
    offset = -torch.rand(n, k // group, generator=g) * 0.05 if offsets else None  # Q5_K's -(dmin * m)
    bias = torch.randn(n, generator=g)
    return QuantizedLinear(q, scale, offset, 8, bias, exact_scales=True)


def _int4_fp32_scales(n: int, k: int, seed: int = 0) -> QuantizedLinear:
    g = torch.Generator().manual_seed(seed)
    q, scale, offset = quantize_int4(torch.randn(n, k, generator=g), 32)
    # Q4_K-like: scale = d * sc, offset = -(dmin * m) with a 6-bit sc / m: exact in fp32, not in fp16
    d = torch.rand(n, 1, generator=g) * 1e-3 + 1e-4
    sc = torch.randint(1, 64, scale.shape, generator=g).float()
    m = torch.randint(0, 64, scale.shape, generator=g).float()
    return QuantizedLinear(q, (d.half().float() * sc), -(d.half().float() * m), 4, None, exact_scales=True)


@pytest.mark.parametrize("group,offsets", [(16, False), (32, False), (64, False), (32, True), (64, True)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_w8g_close_to_its_reference(group, offsets, dtype):
    lin = _int8_grouped(96, 256, group, offsets=offsets)
    lin.prepare(torch.device("cpu"), release=False)
    assert lin.path == "w8g"
    x = (torch.randn(21, 256) * 3).to(dtype)  # 21 rows: a full pass of 16 and a partial one
    x[4] = 0
    x[9, 5] = 1e4
    out = native.w8g_linear(x, lin.state, group, lin.bias_fp32)
    ref = lin.path_reference(x)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-6 * float(ref.abs().max()))
    if offsets:  # the offsets are in the result: the kernel without them is far off
        bare = native.w8g_linear(x, (lin.state[0], lin.state[1], None), group, lin.bias_fp32)
        assert not torch.allclose(bare, ref, rtol=1e-3, atol=1e-3 * float(ref.abs().max()))
    # within int8-activation error of the exact weight-only product
    exact = x.float() @ lin.dequantize().T + lin.bias
    assert float((out - exact).abs().max()) < 0.02 * float(exact.abs().max())


def test_w8g_rejects_a_planted_bug():
    """The comparison above can fail: a wrong scale of one 16-group, or one flipped weight byte, is caught."""
    lin = _int8_grouped(48, 256, 16)
    lin.prepare(torch.device("cpu"), release=False)
    wu, ws, _ = lin.state
    x = torch.randn(3, 256)
    ref = lin.path_reference(x)
    tol = dict(rtol=1e-5, atol=1e-6 * float(ref.abs().max()))
    bad_scale = ws.clone()
    bad_scale[0, 1, 3] *= 1.5  # the second 16-group of output 3 (a kernel reading one scale per 32 would miss it)
    assert not torch.allclose(native.w8g_linear(x, (wu, bad_scale, None), 16, lin.bias_fp32), ref, **tol)
    bad_weight = wu.clone()
    bad_weight.view(-1)[777] ^= 0x40
    assert not torch.allclose(native.w8g_linear(x, (bad_weight, ws, None), 16, lin.bias_fp32), ref, **tol)


def test_w4a8_fp32_scales_close_to_their_reference_and_not_to_fp16():
    lin = _int4_fp32_scales(64, 512)
    lin.prepare(torch.device("cpu"), release=False)
    assert lin.path == "w4a8" and lin.state[1].dtype == torch.float32
    x = torch.randn(9, 512) * 2
    out = native.w4a8_linear(x, lin.state, 32, None)
    ref = lin.path_reference(x)
    tol = dict(rtol=1e-5, atol=1e-6 * float(ref.abs().max()))
    torch.testing.assert_close(out, ref, **tol)
    rounded = native.w4a8_reference(x, unpack_int4(lin.qweight), lin.scale, lin.offset, None)  # fp16 scales
    assert not torch.allclose(out, rounded, **tol)  # the fp32 scales are what ran


def test_requantised_int4_keeps_fp16_scales():
    """A weight quantised here (no ``exact_scales``) keeps today's fp16 form: same layout, same arithmetic."""
    w = torch.randn(64, 256)
    lin = QuantizedLinear.from_weight(w, None, "int4", 32)
    lin.prepare(torch.device("cpu"))
    assert lin.path == "w4a8" and lin.state[1].dtype == torch.float16


@pytest.mark.parametrize("make", ["w8g16", "w8g32", "w8g32_offsets", "w4a8_fp32", "stack"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rows_are_independent(make, dtype):
    """Each row's output is bit-identical alone (a decode), in a window, and among 64 rows (a batch)."""
    if make == "stack":
        parts = [_int4_fp32_scales(64, 256), _int8_grouped(32, 256, 16, seed=1)]
        for p in parts:
            p.prepare(torch.device("cpu"))
        lin = RowStack(parts)
    else:
        lin = {"w8g16": lambda: _int8_grouped(80, 256, 16), "w8g32": lambda: _int8_grouped(80, 256, 32),
               "w8g32_offsets": lambda: _int8_grouped(80, 256, 32, offsets=True),
               "w4a8_fp32": lambda: _int4_fp32_scales(80, 256)}[make]()
        lin.prepare(torch.device("cpu"))
    x = (torch.randn(64, 256) * 2).to(dtype)
    alone = torch.cat([lin(x[i:i + 1]) for i in range(64)])
    for rows in (2, 5, 17, 40, 64):
        assert torch.equal(lin(x[:rows]), alone[:rows]), f"{make}: {rows} rows"


def test_row_stack_concatenates_its_parts():
    parts = [_int4_fp32_scales(64, 256), _int8_grouped(32, 256, 16, seed=1)]
    for p in parts:
        p.prepare(torch.device("cpu"), release=False)
    x = torch.randn(3, 256)
    out = RowStack(parts)(x)
    assert out.shape == (3, 96)
    assert torch.equal(out, torch.cat([parts[0](x), parts[1](x)], -1))


def test_w8g_is_not_used_where_it_does_not_apply():
    q, scale = quantize_int8(torch.randn(40, 256), 32)  # N not a multiple of 16
    lin = QuantizedLinear(q, scale, None, 8)
    lin.prepare(torch.device("cpu"))
    assert lin.path == "weight_only"
    q, scale = quantize_int8(torch.randn(48, 240), 48)  # K not a multiple of 32
    lin = QuantizedLinear(q, scale, None, 8)
    lin.prepare(torch.device("cpu"))
    assert lin.path == "weight_only"
    with pytest.raises(ValueError, match="group of 16 \\(no offsets\\) or a multiple of 32"):
        native.pack_w8g(torch.zeros(48, 256, dtype=torch.int8), torch.ones(48, 32))  # group 8
    with pytest.raises(ValueError, match="offsets=True"):
        native.pack_w8g(torch.zeros(48, 256, dtype=torch.int8), torch.ones(48, 16), torch.zeros(48, 16))  # 16 + offs
