"""QuantizedLinear: formats round-trip, each path against the torch reference of its own arithmetic, row
independence (a row's output is the same alone or with others), and the weight-only reference against the
dequantised matmul."""

from __future__ import annotations

import pytest
import torch

from specdec.model.linear import Linear
from specdec.model.quant import cpu_paths, native
from specdec.model.quant.formats import dequantize, pack_int4, quantize_int4, quantize_int8, unpack_int4
from specdec.model.quant.linear import QuantizedLinear, check_quantization, quantize_linears

SHAPES = [(96, 128), (160, 256), (48, 1536)]  # (N, K); N multiple of 16 so the CPU int4 path applies


def _weight(n, k, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, k, generator=g) * 0.05, torch.randn(n, generator=g) * 0.1


def test_int4_pack_round_trip():
    q = torch.randint(0, 16, (7, 64), dtype=torch.uint8)
    assert torch.equal(unpack_int4(pack_int4(q)), q)


@pytest.mark.parametrize("group", [None, 32])
def test_int8_quantisation_error_within_half_step(group):
    w, _ = _weight(64, 128)
    q, scale = quantize_int8(w, group)
    err = (dequantize(q, scale, None, 8) - w).abs()
    step = scale.repeat_interleave(128 // scale.shape[1], 1)
    assert bool((err <= step / 2 + 1e-7).all())


@pytest.mark.parametrize("group", [32, 64])
def test_int4_quantisation_error_within_half_step(group):
    w, _ = _weight(64, 128)
    q, scale, offset = quantize_int4(w, group)
    err = (dequantize(q, scale, offset, 4) - w).abs()
    step = scale.repeat_interleave(group, 1)
    assert bool((err <= step / 2 + 1e-6).all())


@pytest.mark.parametrize("scheme", ["int8", "int4"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_weight_only_reference_is_the_dequantised_matmul(scheme, dtype):
    w, b = _weight(96, 128)
    m = QuantizedLinear.from_weight(w, b.to(dtype), scheme)
    x = torch.randn(5, 128).to(dtype)
    expected = (x.double() @ m.dequantize().double().T + b.to(dtype).double())
    torch.testing.assert_close(m(x).double(), expected.to(dtype).double(), rtol=1e-5 if dtype == torch.float32
                               else 1e-2, atol=1e-5 if dtype == torch.float32 else 1e-2)
    assert m(x).dtype == dtype


def _w8a8_backend(cpu_path: str) -> str:
    if cpu_path == "auto" and not native.available():
        pytest.skip("no AVX-512 VNNI or no C compiler here")
    if cpu_path == "torch" and not cpu_paths.w8a8_available():
        pytest.skip("no oneDNN int8 linear in this torch")
    return "native" if cpu_path == "auto" else "onednn"


def _w8a8_run(m: QuantizedLinear, x: torch.Tensor) -> torch.Tensor:
    """fp32 output of ``m``'s w8a8 backend (before any cast)."""
    if m.backend == "native":
        return native.w8a8_linear(x, m.state, m.bias)
    return cpu_paths.w8a8_linear(x, m.state, m.bias)


@pytest.mark.parametrize("n,k", SHAPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("cpu_path", ["auto", "torch"])  # specdec's native kernel, oneDNN's int8 GEMM
def test_w8a8_equals_its_reference_exactly(n, k, dtype, cpu_path):
    backend = _w8a8_backend(cpu_path)
    w, b = _weight(n, k)
    m = QuantizedLinear.from_weight(w, b, "int8")
    m.prepare(torch.device("cpu"), cpu_path, release=False)
    assert (m.path, m.backend) == ("w8a8", backend)
    x = (torch.randn(37, k) * 3).to(dtype)  # 37 rows: passes of 12 + 12 + 13 in the native kernel
    x[3] = 0  # an all-zero row
    x[5, 7] = 1e4  # an outlier row
    out = torch.cat([_w8a8_run(m, x[i:i + 4]) for i in range(0, 37, 4)])
    assert torch.equal(out, m.path_reference(x))
    assert torch.equal(_w8a8_run(m, x), out)  # all rows at once: the same bits
    assert torch.equal(m(x), out.to(dtype))  # the module's own call (its prepared fp32 bias), one rounding


def test_native_w8a8_rejects_a_planted_bug():
    """The exact comparison above can fail: one weight byte changed in the native layout is caught."""
    _w8a8_backend("auto")
    w, b = _weight(48, 256)
    m = QuantizedLinear.from_weight(w, b, "int8")
    m.prepare(torch.device("cpu"), release=False)
    wu, ws = m.state
    bad = wu.clone()
    bad.view(-1)[777] += 1
    x = torch.randn(3, 256)
    assert not torch.equal(native.w8a8_linear(x, (bad, ws), m.bias), m.path_reference(x))


@pytest.mark.parametrize("scheme,cpu_path", [("int8", "auto"), ("int4", "auto"), ("int8", "torch")])
def test_non_finite_activations_give_non_finite_rows(scheme, cpu_path):
    """A NaN or an infinity in a row's input makes that row's output NaN (never finite garbage the engine's check
    would miss); the other rows are untouched."""
    if cpu_path == "torch":
        _w8a8_backend("torch")
    elif not native.available():
        pytest.skip("no AVX-512 VNNI or no C compiler here")
    w, b = _weight(48, 256)
    m = QuantizedLinear.from_weight(w, b, scheme)
    m.prepare(torch.device("cpu"), cpu_path)
    x = torch.randn(4, 256)
    clean = m(x)
    x[1, 100], x[2, 3] = float("nan"), float("inf")
    out = m(x)
    assert not torch.isfinite(out[1]).any() and not torch.isfinite(out[2]).any()
    assert torch.equal(out[[0, 3]], clean[[0, 3]])


@pytest.mark.skipif(not cpu_paths.int4pack_available(), reason="no _weight_int4pack_mm_for_cpu in this torch")
@pytest.mark.parametrize("n,k", SHAPES)
@pytest.mark.parametrize("group", [32, 64])
def test_int4pack_close_to_its_reference(n, k, group):
    w, b = _weight(n, k)
    m = QuantizedLinear.from_weight(w, b, "int4", group)
    m.prepare(torch.device("cpu"), "torch", release=False)
    assert m.path == "int4pack"
    x = torch.randn(16, k)
    ref = m.path_reference(x)
    out = cpu_paths.int4pack_linear(x, m.state, group, m.bias)
    # the op rounds its output to bf16: half a bf16 ulp of the largest output, plus accumulation-order slack
    torch.testing.assert_close(out, ref, rtol=1e-2, atol=1e-2 * float(ref.abs().max()))


needs_w4a8 = pytest.mark.skipif(not native.available(), reason="no AVX-512 VNNI or no C compiler here")


@needs_w4a8
@pytest.mark.parametrize("n,k", SHAPES)
@pytest.mark.parametrize("group", [32, 64, 128])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_w4a8_close_to_its_reference(n, k, group, dtype):
    if k % group:
        pytest.skip("group does not divide K")
    w, b = _weight(n, k)
    m = QuantizedLinear.from_weight(w, b, "int4", group)
    m.prepare(torch.device("cpu"), release=False)
    assert m.path == "w4a8"
    x = (torch.randn(21, k) * 3).to(dtype)  # 21 rows: one full pass of 16 and a partial one
    x[4] = 0  # an all-zero row (every block's scale is 1)
    x[7, :32] = 0  # one all-zero block
    x[9, 5] = 1e4  # an outlier: its block's other values quantise to ~0
    out = native.w4a8_linear(x, m.state, group, m.bias)
    ref = m.path_reference(x)
    # block dots are exact; the kernel's fused multiply-adds round once per block where the reference rounds in fp64
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-6 * float(ref.abs().max()))
    # and it stays within int8-activation error of the weight-only result
    wo = m.dequantize() @ x.float().T
    assert float((out - b - wo.T).abs().max()) < 0.02 * float(wo.abs().max())


@needs_w4a8
def test_w4a8_bf16_in_and_out_equal_the_fp32_path_rounded():
    """The kernel reads bf16 activations as their fp32 values and writes bf16 as torch rounds fp32 (nearest even),
    after adding the bias: bit for bit what the fp32 path followed by ``.to(bfloat16)`` gives."""
    w, b = _weight(96, 256)
    m = QuantizedLinear.from_weight(w, b.to(torch.bfloat16), "int4", 32)
    m.prepare(torch.device("cpu"))
    x = (torch.randn(7, 256) * 4).to(torch.bfloat16)
    fp32 = native.w4a8_linear(x.float(), m.state, 32, m.bias)
    assert torch.equal(native.w4a8_linear(x, m.state, 32, m.bias), fp32)
    assert torch.equal(native.w4a8_linear(x, m.state, 32, m.bias, out_dtype=torch.bfloat16), fp32.to(torch.bfloat16))
    assert m(x).dtype == torch.bfloat16 and torch.equal(m(x), fp32.to(torch.bfloat16))
    half = native.w4a8_linear(x.half(), m.state, 32, m.bias, out_dtype=torch.float16)  # other dtypes via fp32
    assert half.dtype == torch.float16


@needs_w4a8
def test_w4a8_reference_rejects_a_planted_bug():
    """The comparison above can fail: a kernel state with one nibble flipped is caught."""
    w, b = _weight(48, 1536)
    m = QuantizedLinear.from_weight(w, b, "int4", 32)
    m.prepare(torch.device("cpu"), release=False)
    wq, ws, wo = m.state
    bad = wq.clone()
    bad.view(-1)[12345] ^= 0x10  # one high nibble of one output's weight
    x = torch.randn(3, 1536)
    ref = m.path_reference(x)
    assert not torch.allclose(native.w4a8_linear(x, (bad, ws, wo), 32, m.bias), ref, rtol=1e-5,
                              atol=1e-6 * float(ref.abs().max()))


def test_w4a8_is_not_used_where_it_does_not_apply():
    w, b = _weight(40, 128)  # N not a multiple of 16
    m = QuantizedLinear.from_weight(w, b, "int4", 32)
    m.prepare(torch.device("cpu"))
    assert m.path != "w4a8"
    w, b = _weight(48, 128)
    m = QuantizedLinear.from_weight(w, b, "int4", 32)
    m.offset[0, 0] = 1e6  # does not fit the kernel's fp16 offsets
    m.prepare(torch.device("cpu"))
    assert m.path != "w4a8"
    with pytest.raises(ValueError, match="fp16"):
        native.pack_w4a8(torch.zeros(48, 128, dtype=torch.uint8), torch.ones(48, 4), torch.full((48, 4), 1e6))


@pytest.mark.parametrize("scheme,group", [("int8", None), ("int8", 32), ("int4", 32), ("int4", 64)])
@pytest.mark.parametrize("cpu_path", ["auto", "weight_only", "torch"])
def test_rows_are_independent(scheme, group, cpu_path):
    """Each row's output is bit-identical whether computed alone (decode) or among 2..33 rows (windows)."""
    w, b = _weight(160, 256)
    m = QuantizedLinear.from_weight(w, b, scheme, group)
    m.prepare(torch.device("cpu"), cpu_path)
    x = torch.randn(33, 256) * 2
    alone = torch.cat([m(x[i:i + 1]) for i in range(33)])
    for rows in (2, 5, 8, 16, 17, 33):  # 17 and 33: more rows than one pass of the w4a8 kernel takes
        assert torch.equal(m(x[:rows]), alone[:rows]), f"{scheme} g{group} {m.path}: {rows} rows"


def test_prepare_releases_the_quantised_tensors():
    w, b = _weight(96, 128)
    m = QuantizedLinear.from_weight(w, b, "int8")
    m.prepare(torch.device("cpu"))
    if m.path == "weight_only":
        pytest.skip("no CPU fast path here")
    assert m.qweight.device.type == "meta"
    with pytest.raises(ValueError, match="replaced"):
        m.dequantize()


def test_quantize_linears_skips_a_tied_head():
    model = torch.nn.Module()
    model.embed = torch.nn.Embedding(32, 64)
    model.proj = Linear(64, 64, bias=True)
    model.head = Linear(64, 32, bias=False)
    model.head.weight = model.embed.weight
    assert quantize_linears(model, "int4") == 1
    assert isinstance(model.proj, QuantizedLinear) and isinstance(model.head, Linear)


@pytest.mark.parametrize("args,match", [
    (("int3", None), "'int8', 'int4' or 'gguf'"), (("int4", 3), "even"), (("int8", 0), ">= 2"),
    ((None, 32), "without"), (("int4", True), "integer"), (("gguf", 32), "file's own groups"),
])
def test_bad_settings_are_refused(args, match):
    with pytest.raises(ValueError, match=match):
        check_quantization(*args)


def test_group_must_divide_input_width():
    w, b = _weight(16, 96)
    with pytest.raises(ValueError, match="dividing"):
        QuantizedLinear.from_weight(w, b, "int4", 64)


def test_w4a8_falls_back_when_it_cannot_be_built(monkeypatch, tmp_path, caplog):
    """A failing compiler (or SPECDEC_NATIVE=0) leaves int4 on torch's kernel, with a warning naming why."""
    monkeypatch.setenv("SPECDEC_CACHE", str(tmp_path))  # nothing built there yet
    monkeypatch.setenv("CC", "false")  # a "compiler" that always fails
    native._library.cache_clear()
    try:
        with caplog.at_level("WARNING"):
            built = native.available()
        if {"avx512f", "avx512bw", "avx512_vnni", "f16c"} <= native.cpu_flags():
            assert not built and "building specdec_native failed" in caplog.text
        w, b = _weight(48, 128)
        m = QuantizedLinear.from_weight(w, b, "int4", 32)
        m.prepare(torch.device("cpu"))
        assert m.path != "w4a8"
        native._library.cache_clear()
        monkeypatch.setenv("SPECDEC_NATIVE", "0")
        assert not native.available()
    finally:
        native._library.cache_clear()  # the next caller builds (or finds) the real kernel again


def test_w8a8_packing_in_slices_equals_the_layout():
    """pack_w8a8 packs 2048 rows at a time: across slice boundaries the layout is still wu[t, c, lane, b] =
    q[16 t + lane, 4 c + b] + 128."""
    q = torch.randint(-127, 128, (4112, 32), dtype=torch.int8)
    wu, ws = native.pack_w8a8(q, torch.ones(4112, 1))
    expected = (q.to(torch.int16) + 128).to(torch.uint8).reshape(257, 16, 8, 4).permute(0, 2, 1, 3)
    assert torch.equal(wu, expected) and ws.shape == (4112,)
