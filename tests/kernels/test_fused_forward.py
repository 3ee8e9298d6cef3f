"""The forward's fused elementwise kernels (RMSNorm with the residual add, SiLU-mul, rope + paged K/V write)
against their torch references, which are the CPU path and the oracle.

CPU tensors run the kernels in the Triton interpreter (tests/conftest.py sets TRITON_INTERPRET=1); with CUDA the
same tests run the compiled kernels. The references' rounding is reproduced in the kernels (products and sums
rounded to the model dtype where torch rounds them), so rope and SiLU-mul match bit for bit in the interpreter and
RMSNorm to its reduction order - except bf16 in the interpreter, whose fp32 -> bf16 cast does not round to
nearest as torch and the GPU do (up to one bf16 ulp per rounding there).
"""

import os

import pytest
import torch

from specdec.kernels.rms_norm import (
    MAX_HIDDEN,
    fused_add_rms_norm,
    fused_add_rms_norm_reference,
    rms_norm_config,
    rms_norm_reference,
)
from specdec.kernels.rope_kv import rope_write_kv, rope_write_kv_reference
from specdec.kernels.silu_mul import silu_mul, silu_mul_reference

DEVICES = [
    pytest.param(
        "cpu", marks=pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="needs TRITON_INTERPRET=1")
    ),
    pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")),
]
DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def _norm_tol(device: str, dtype: torch.dtype) -> dict:
    """The mean's summation order differs: fp32 a few ulp; fp16/bf16 an ulp of the normalised row here and there,
    which the rounded weight multiply makes up to two ulp of the output (bf16: 2^-6 relative)."""
    if dtype == torch.float32:
        return {"rtol": 1e-5 if device == "cpu" else 1e-4, "atol": 1e-6}
    if dtype == torch.bfloat16 and device == "cpu":
        return _exact_tol(device, dtype)
    return {"rtol": 1.6e-2, "atol": 1e-3} if dtype == torch.bfloat16 else {"rtol": 2e-3, "atol": 1e-4}


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,hidden", [(1, 64), (5, 576), (3, 111)])
@pytest.mark.parametrize("with_residual", [False, True])
def test_rms_norm_matches_reference(device, dtype, rows, hidden, with_residual):
    g = torch.Generator().manual_seed(rows * hidden)
    x = (torch.randn(rows, hidden, generator=g) * 3).to(dtype)
    residual = torch.randn(rows, hidden, generator=g).to(dtype) if with_residual else None
    weight = (1 + 0.1 * torch.randn(hidden, generator=g)).to(dtype)
    ref_out, ref_stream = fused_add_rms_norm_reference(x, weight, 1e-6, residual)
    res_dev = residual.to(device).clone() if with_residual else None
    out, stream = fused_add_rms_norm(x.to(device), weight.to(device), 1e-6, res_dev)
    # the stream is an add rounded once: exact in every dtype
    torch.testing.assert_close(stream.cpu(), ref_stream, **_exact_tol(device, dtype))
    if with_residual:
        assert stream.data_ptr() == res_dev.data_ptr()  # written into the residual's storage, no new buffer
    torch.testing.assert_close(out.cpu(), ref_out, **_norm_tol(device, dtype))
    assert out.dtype == dtype and out.shape == (rows, hidden)


def test_rms_norm_reference_is_the_gpt_fast_norm():
    """The reference is the module the CPU forward ran before the fused layer: fp32 math, cast, then weight."""
    x = torch.randn(4, 32).to(torch.bfloat16)
    w = torch.randn(32).to(torch.bfloat16)
    x32 = x.float()
    expected = w * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + 1e-5)).to(torch.bfloat16)
    assert torch.equal(rms_norm_reference(x, w, 1e-5), expected)
    r = torch.randn(4, 32).to(torch.bfloat16)
    out, stream = fused_add_rms_norm_reference(x, w, 1e-5, r)
    assert torch.equal(stream, x + r) and torch.equal(out, rms_norm_reference(x + r, w, 1e-5))


@pytest.mark.parametrize("device", DEVICES)
def test_rms_norm_input_errors(device):
    x = torch.randn(2, 8, device=device)
    with pytest.raises(ValueError, match="weight must be"):
        fused_add_rms_norm(x, torch.ones(7, device=device), 1e-6)
    with pytest.raises(ValueError, match="residual must match"):
        fused_add_rms_norm(x, torch.ones(8, device=device), 1e-6, torch.zeros(2, 8, device=device,
                                                                              dtype=torch.float16))
    with pytest.raises(ValueError, match="unit column stride"):
        fused_add_rms_norm(torch.randn(8, 2, device=device).t(), torch.ones(8, device=device), 1e-6)
    with pytest.raises(ValueError, match="hidden"):
        rms_norm_config(MAX_HIDDEN + 1)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,inter", [(1, 64), (4, 1536), (3, 77)])
def test_silu_mul_matches_reference(device, dtype, rows, inter):
    g = torch.Generator().manual_seed(rows + inter)
    gate_up = (torch.randn(rows, 2 * inter, generator=g) * 4).to(dtype)
    out = silu_mul(gate_up.to(device)).cpu()
    ref = silu_mul_reference(gate_up)
    # exp's last bits may differ (then one ulp of silu, which the rounded multiply can make two of the output)
    tol = {"rtol": 1e-6, "atol": 1e-6} if dtype == torch.float32 else {
        "rtol": 3 * 2**-7 if dtype == torch.bfloat16 else 2 * 2**-10, "atol": 1e-3}
    torch.testing.assert_close(out, ref, **tol)


def _exact_tol(device: str, dtype: torch.dtype) -> dict:
    """Bit for bit, but for the interpreter's bf16 cast (an ulp per rounding, 2^-7 of the operands: a sum that
    cancels keeps the operands' absolute error) and an FMA the GPU's fp32 compile may contract (one fp32 ulp)."""
    if dtype == torch.bfloat16 and device == "cpu":
        return {"rtol": 2**-5, "atol": 2**-5}
    if dtype == torch.float32 and device == "cuda":
        return {"rtol": 1e-6, "atol": 1e-6}
    return {"rtol": 0, "atol": 0}


def _rope_case(dtype, tokens, num_heads, num_kv_heads, head_dim, cache_dtype=None, seed=0):
    g = torch.Generator().manual_seed(seed)
    block_size, num_blocks, max_pos = 4, 16, 64
    qkv = torch.randn(tokens, (num_heads + 2 * num_kv_heads) * head_dim, generator=g).to(dtype)
    positions = torch.randint(0, max_pos, (tokens,), generator=g)
    inv = 1.0 / (10000 ** (torch.arange(0, head_dim, 2).float() / head_dim))
    freqs = torch.outer(torch.arange(max_pos).float(), inv)
    emb = torch.cat([freqs, freqs], dim=-1)
    slots = torch.randperm(num_blocks * block_size, generator=g)[:tokens]
    cache = torch.zeros(num_blocks, block_size, num_kv_heads, head_dim, dtype=cache_dtype or dtype)
    return qkv, positions, emb.cos().contiguous(), emb.sin().contiguous(), cache, slots


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens,heads,kv_heads,head_dim", [(1, 4, 2, 64), (5, 9, 3, 64), (3, 2, 1, 16),
                                                            (2, 2, 2, 128)])
def test_rope_write_kv_matches_reference(device, dtype, tokens, heads, kv_heads, head_dim):
    qkv, positions, cos, sin, cache, slots = _rope_case(dtype, tokens, heads, kv_heads, head_dim, seed=tokens)
    k_ref, v_ref = cache.clone(), cache.clone()
    q_ref = rope_write_kv_reference(qkv, positions, cos, sin, k_ref, v_ref, slots, heads, kv_heads)
    k_dev, v_dev = cache.clone().to(device), cache.clone().to(device)
    q = rope_write_kv(qkv.to(device), positions.to(device), cos.to(device), sin.to(device), k_dev, v_dev,
                      slots.to(device), heads, kv_heads)
    # every product of two model-dtype values is exact in fp32, so the kernel rounds as torch does
    tol = _exact_tol(device, dtype)
    torch.testing.assert_close(q.cpu(), q_ref, **tol)
    torch.testing.assert_close(k_dev.cpu(), k_ref, **tol)
    torch.testing.assert_close(v_dev.cpu(), v_ref, rtol=0, atol=0)
    untouched = torch.ones(cache.shape[0] * cache.shape[1], dtype=torch.bool)
    untouched[slots] = False
    assert not k_dev.cpu().flatten(0, 1)[untouched].any()  # nothing written outside the token's slots


@pytest.mark.parametrize("device", DEVICES)
def test_rope_write_kv_casts_into_the_cache_dtype_and_skips_negative_slots(device):
    qkv, positions, cos, sin, cache, slots = _rope_case(torch.float32, 3, 2, 1, 16, cache_dtype=torch.bfloat16)
    slots[1] = -1
    k_dev, v_dev = cache.clone().to(device), cache.clone().to(device)
    rope_write_kv(qkv.to(device), positions.to(device), cos.to(device), sin.to(device), k_dev, v_dev,
                  slots.to(device), 2, 1)
    k_ref, v_ref = cache.clone(), cache.clone()
    keep = torch.tensor([0, 2])
    rope_write_kv_reference(qkv[keep], positions[keep], cos, sin, k_ref, v_ref, slots[keep], 2, 1)
    torch.testing.assert_close(k_dev.cpu(), k_ref, **_exact_tol(device, torch.bfloat16))
    torch.testing.assert_close(v_dev.cpu(), v_ref, **_exact_tol(device, torch.bfloat16))
    assert not k_dev.cpu().flatten(0, 1)[slots[1]].any()  # the skipped token's (old, random) slot stays empty


@pytest.mark.parametrize("device", DEVICES)
def test_rope_write_kv_input_errors(device):
    qkv, positions, cos, sin, cache, slots = _rope_case(torch.float32, 2, 2, 1, 16)
    args = [t.to(device) for t in (qkv, positions, cos, sin, cache, cache.clone(), slots)]
    with pytest.raises(ValueError, match="columns"):
        rope_write_kv(*args, 3, 1)
    with pytest.raises(ValueError, match="positions must be a contiguous int64"):
        rope_write_kv(args[0], args[1].int(), *args[2:], 2, 1)
    with pytest.raises(ValueError, match="cos must be"):
        rope_write_kv(args[0], args[1], args[2].double(), *args[3:], 2, 1)
