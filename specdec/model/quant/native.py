"""specdec's own CPU kernels, built with the system's C compiler at first use and called through ctypes: "w4a8"
(``native/w4a8.c``: int4 weights x per-block int8 activations) and the native "w8a8" (``native/w8a8.c``: int8
weights x per-row int8 activations, the arithmetic of ``cpu_paths.w8a8_reference`` bit for bit, in place of
oneDNN's int8 GEMM), both AVX-512 VNNI; their weight packing; and the torch reference of w4a8's arithmetic.

Why a C kernel: torch's CPU int4 op (``_weight_int4pack_mm_for_cpu``) streams ~7 GB/s at one row and re-reads the
weight for every further row, so int4 on this CPU decoded no faster than bf16 (docs/benchmarks.md, "Quantized
linears"). The kernel reads each weight byte once for up to 16 rows and multiplies int4 weights by int8 activations
with VNNI, as llama.cpp does for Q4 x Q8 blocks. The activations are quantised per row and block of 32 inputs, so
like "w8a8" it is a different arithmetic from the weight-only reference; the arithmetic is spelled out in
``w4a8.c`` and repeated by ``w4a8_reference``. A row's output does not depend on the other rows of the call.

Where it is unavailable (no AVX-512 VNNI, no C compiler, ``SPECDEC_NATIVE=0``) ``available()`` is False and
``QuantizedLinear`` keeps to its other paths. The built library lives in ``$SPECDEC_CACHE/native/<source hash>/``.

The native w8a8 kernel reads each int8 weight once for up to 16 rows with one vpdpbusd per 64 weights and row;
oneDNN's int8 GEMM streamed the same weights at about half the rate at one row (docs/benchmarks.md).
"""

from __future__ import annotations

import ctypes
import functools
from pathlib import Path

import torch

from specdec.kernels.cpu.build import build_library, cpu_flags

NATIVE_DIR = Path(__file__).parent / "native"
SOURCES = [NATIVE_DIR / name for name in ("w4a8.c", "w8a8.c", "w8g.c")]  # compiled into one library
HEADERS = [NATIVE_DIR / name for name in ("common.h", "act_blocks.h")]  # what they share (part of the build's hash)
TILE_N = 16  # outputs per tile (one zmm of fp32 lanes)
BLOCK_K = 32  # inputs per activation block (one int8 scale per row and block)
# -ffp-contract=off: no multiply-add is fused unless the source says so (_mm512_fmadd_ps): the kernels' rounding is
# the one their headers and the torch references spell out
CFLAGS = ["-O3", "-ffp-contract=off", "-mavx512f", "-mavx512bw", "-mavx512vnni", "-mf16c", "-mfma", "-fopenmp",
          "-fPIC", "-shared"]


@functools.cache
def _library() -> ctypes.CDLL | None:
    """Build (once per source version) and load the native kernels; None where they cannot run here."""
    if not {"avx512f", "avx512bw", "avx512_vnni", "f16c"} <= cpu_flags():
        return None
    lib = build_library("specdec_native", SOURCES, HEADERS, CFLAGS,
                        "int4 linears use torch's slower int4 kernel, int8 ones oneDNN's int8 GEMM")
    if lib is None:
        return None
    fn = lib.specdec_w4a8_gemm
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    cint = ctypes.c_int
    fn.argtypes = [ptr, cint, i64, i64, ptr, ptr, ptr, cint, ptr, i64, i64, ptr, cint, cint]
    fn.restype = ctypes.c_int
    fn8 = lib.specdec_w8a8_gemm
    fn8.argtypes = [ptr, cint, i64, i64, ptr, ptr, ptr, i64, ptr, cint, cint]
    fn8.restype = ctypes.c_int
    fng = lib.specdec_w8g_gemm
    fng.argtypes = [ptr, cint, i64, i64, ptr, ptr, ptr, ptr, i64, i64, ptr, cint, cint]
    fng.restype = ctypes.c_int
    return lib


def available() -> bool:
    """True where the native kernels (w4a8, w8a8) are built and load on this CPU."""
    return _library() is not None


def supports(out_features: int, in_features: int, group_size: int) -> bool:
    """The shapes the w4a8 kernel takes: N a multiple of 16, K of 32, the group a multiple of 32 dividing K."""
    return out_features % TILE_N == 0 and in_features % BLOCK_K == 0 and group_size % BLOCK_K == 0 and (
        in_features % group_size == 0)


def fits_fp16(scale: torch.Tensor, offset: torch.Tensor) -> bool:
    """True where every scale and offset is finite once rounded to fp16 (the kernel's format)."""
    return bool(torch.isfinite(scale.to(torch.float16)).all() and torch.isfinite(offset.to(torch.float16)).all())


def exact_in_fp16(t: torch.Tensor) -> bool:
    """True where every value of ``t`` (fp32) is held exactly by fp16."""
    return bool((t.to(torch.float16).float() == t).all())


def w4a8_fp32_scales(scale: torch.Tensor, offset: torch.Tensor, exact_scales: bool) -> bool:
    """Whether w4a8 holds this weight's scales and offsets in fp32: only a file's own (``exact_scales``) that fp16
    cannot hold exactly (Q4_K's ``d * sc``, ``dmin * m``); everything else in fp16."""
    return exact_scales and not (exact_in_fp16(scale) and exact_in_fp16(offset))


def pack_w4a8(q: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor,
              exact_scales: bool = False) -> tuple[torch.Tensor, ...]:
    """The kernel's layout of an int4 weight: ``q`` unpacked uint8 ``[N, K]`` in [0, 15], ``scale`` / ``offset`` fp32
    ``[N, G]``. Returns (wq uint8 ``[N/16, K/8, 16, 4]``, ws ``[N/16, G, 16]``, wo ``[N/16, G, 16]``).

    Scales and offsets are held in fp16 (``ValueError`` where one is not finite there) - rounded, for a weight
    quantised here - unless ``exact_scales`` (a GGUF's own blocks) and fp16 cannot hold them exactly (Q4_K's
    ``d * sc`` and ``dmin * m``): then in fp32, so that the kernel multiplies by the file's values."""
    n, k = q.shape
    g = scale.shape[1]
    if not supports(n, k, k // g):
        raise ValueError(f"w4a8 needs out_features % 16 == 0, in_features % 32 == 0 and a group that is a multiple "
                         f"of 32; got N={n}, K={k}, group={k // g}")
    if w4a8_fp32_scales(scale, offset, exact_scales):
        ws, wo = scale.float(), offset.float()
    elif not fits_fp16(scale, offset):
        raise ValueError("w4a8 holds scales and offsets in fp16; this weight's do not fit there")
    else:
        ws, wo = scale.to(torch.float16), offset.to(torch.float16)
    tiles = q.reshape(n // TILE_N, TILE_N, k // 8, 2, 4).to(torch.uint8)  # (T, lane, chunk, half, b)
    nibbles = tiles[:, :, :, 0, :] | (tiles[:, :, :, 1, :] << 4)  # (T, lane, chunk, b)
    wq = nibbles.permute(0, 2, 1, 3).contiguous()  # (T, chunk, lane, b)
    return wq, _by_tile(ws), _by_tile(wo)


def _by_tile(t: torch.Tensor) -> torch.Tensor:
    """Per-group tensor ``[N, G]`` -> the kernels' ``[N/16, G, 16]`` (a tile's 16 outputs side by side)."""
    n, g = t.shape
    return t.reshape(n // TILE_N, TILE_N, g).transpose(1, 2).contiguous()


def _kernel_io(x: torch.Tensor, n: int, out_dtype: torch.dtype | None, bias: torch.Tensor | None) -> tuple:
    """What a native kernel call takes: ``x`` as fp32 or bf16 (other dtypes through fp32), contiguous; the output
    ``[M, n]`` in fp32 or bf16 (``out_dtype`` if it is one of them, else fp32: cast after); the bias as fp32
    (``QuantizedLinear`` passes one converted at prepare time, so this is no copy on its path)."""
    if x.dtype not in (torch.float32, torch.bfloat16):
        x = x.float()
    out_dtype = out_dtype or torch.float32
    kernel_out = out_dtype if out_dtype in (torch.float32, torch.bfloat16) else torch.float32
    y = torch.empty(x.shape[0], n, dtype=kernel_out)
    bias32 = bias.float().contiguous() if bias is not None else None
    return x.contiguous(), y, bias32, out_dtype


def _ptr(t: torch.Tensor | None) -> int | None:
    return t.data_ptr() if t is not None else None


def _check(rc: int, kernel: str, m: int, k: int) -> None:
    if rc != 0:
        raise MemoryError(f"{kernel}: could not allocate scratch for {m} x {k} activations")


def w4a8_linear(x: torch.Tensor, state: tuple[torch.Tensor, ...], group_size: int, bias: torch.Tensor | None,
                threads: int | None = None, out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """``x [M, K]`` through the kernel: ``[M, N]`` in ``out_dtype`` (default fp32). fp32 and bf16 inputs are read
    as they are and fp32 / bf16 outputs written by the kernel (the bias added to the fp32 result first, then one
    rounding); other dtypes go through fp32."""
    lib = _library()
    assert lib is not None, "w4a8 kernel unavailable: check native.available() first"
    wq, ws, wo = state
    m, k = x.shape
    n = wq.shape[0] * TILE_N
    x, y, bias32, out_dtype = _kernel_io(x, n, out_dtype, bias)
    if m:
        rc = lib.specdec_w4a8_gemm(x.data_ptr(), int(x.dtype == torch.bfloat16), m, k, wq.data_ptr(), ws.data_ptr(),
                                   wo.data_ptr(), int(ws.dtype == torch.float32), _ptr(bias32), n, group_size,
                                   y.data_ptr(), int(y.dtype == torch.bfloat16), threads or torch.get_num_threads())
        _check(rc, "w4a8", m, k)
    return y.to(out_dtype)


def supports_w8a8(out_features: int, in_features: int) -> bool:
    """The shapes the w8a8 kernel takes: N a multiple of 16, K of 16 and below 66000 (int32 sums stay exact)."""
    return out_features % TILE_N == 0 and in_features % 16 == 0 and in_features < 66000


def pack_w8a8(q: torch.Tensor, scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The w8a8 kernel's layout of an int8 per-channel weight (``q`` int8 ``[N, K]``, ``scale`` fp32 ``[N, 1]``):
    (wu uint8 ``[N/16, K/4, 16, 4]`` holding q + 128, ws fp32 ``[N]``)."""
    n, k = q.shape
    if not supports_w8a8(n, k) or scale.shape != (n, 1):
        raise ValueError(f"w8a8 needs a per-channel int8 weight with out_features % 16 == 0 and in_features % 16 == 0"
                         f"; got N={n}, K={k}, scale {tuple(scale.shape)}")
    return _pack_shifted_int8(q), scale.reshape(n).float().contiguous()


def _pack_shifted_int8(q: torch.Tensor) -> torch.Tensor:
    """int8 ``q [N, K]`` -> the w8a8 / w8g layout: uint8 ``[N/16, K/4, 16, 4]`` holding q + 128 (tile, chunk of 4
    inputs, lane, byte), packed a slice of rows at a time so the temporaries stay small beside the weight."""
    n, k = q.shape
    wu = torch.empty(n // TILE_N, k // 4, TILE_N, 4, dtype=torch.uint8)  # (T, chunk, lane, b)
    rows = 2048  # a multiple of 16
    for start in range(0, n, rows):
        shifted = q[start : start + rows].contiguous().view(torch.uint8) ^ 0x80  # two's complement q + 128
        tiles = shifted.reshape(-1, TILE_N, k // 4, 4).permute(0, 2, 1, 3)  # (t, chunk, lane, b)
        wu[start // TILE_N : start // TILE_N + tiles.shape[0]] = tiles
    return wu


def w8a8_linear(x: torch.Tensor, state: tuple[torch.Tensor, torch.Tensor], bias: torch.Tensor | None,
                threads: int | None = None, out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """``x [M, K]`` through the native w8a8 kernel: ``[M, N]`` in ``out_dtype`` (default fp32); bit for bit
    ``cpu_paths.w8a8_reference`` (then one rounding to bf16 where asked)."""
    lib = _library()
    assert lib is not None, "native kernels unavailable: check native.available() first"
    wu, ws = state
    m, k = x.shape
    n = ws.shape[0]
    x, y, bias32, out_dtype = _kernel_io(x, n, out_dtype, bias)
    if m:
        rc = lib.specdec_w8a8_gemm(x.data_ptr(), int(x.dtype == torch.bfloat16), m, k, wu.data_ptr(), ws.data_ptr(),
                                   _ptr(bias32), n, y.data_ptr(), int(y.dtype == torch.bfloat16),
                                   threads or torch.get_num_threads())
        _check(rc, "w8a8", m, k)
    return y.to(out_dtype)


def quantize_activations(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The kernel's activation quantisation of ``x [M, K]``: ``xq`` fp32 ``[M, K/32, 32]`` (integers in
    [-127, 127]), ``xs`` and ``xsum`` fp32 ``[M, K/32]`` (block scale, scale * sum of the block's integers; NaN
    for a block holding a NaN or an infinity)."""
    m, k = x.shape
    xb = x.float().reshape(m, k // BLOCK_K, BLOCK_K)
    amax = xb.abs().amax(-1)  # (M, B)
    xs = torch.where(amax > 0, amax / 127, torch.ones_like(amax))
    xs = torch.where(torch.isfinite(amax), xs, torch.full_like(amax, float("nan")))  # NaN / inf in the block: NaN
    xq = torch.round(xb / xs[..., None]).nan_to_num_(0.0).clamp_(-127, 127)
    return xq, xs, xs * xq.sum(-1)


def w4a8_reference(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor,
                   bias: torch.Tensor | None, exact_scales: bool = False) -> torch.Tensor:
    """The w4a8 arithmetic in torch: ``x [M, K]``, ``q`` unpacked uint8 ``[N, K]``, ``scale`` / ``offset`` fp32
    ``[N, G]`` (rounded to fp16 as the kernel holds them, unless ``exact_scales`` as in ``pack_w4a8``); fp32
    ``[M, N]``. Block dots are exact; the kernel's fused multiply-adds round once per block where this rounds twice,
    so compare with a tolerance."""
    n, k = q.shape
    xq, xs, xsum = quantize_activations(x)  # (M, B, 32), (M, B), (M, B)
    blocks = k // BLOCK_K
    per_group = blocks // scale.shape[1]
    if not w4a8_fp32_scales(scale, offset, exact_scales):
        scale, offset = scale.to(torch.float16).float(), offset.to(torch.float16).float()
    s = scale.float().repeat_interleave(per_group, 1)  # (N, B)
    o = offset.float().repeat_interleave(per_group, 1)  # (N, B)
    qb = q.double().reshape(n, blocks, BLOCK_K)  # (N, B, 32)
    dots = torch.einsum("mbk,nbk->mnb", xq.double(), qb)  # (M, N, B) exact integer dots
    terms = dots * (s[None] * xs[:, None, :]).double() + o[None].double() * xsum[:, None, :].double()
    out = terms.sum(-1).float()
    return out + bias.float() if bias is not None else out


def supports_w8g(out_features: int, in_features: int, group_size: int, offsets: bool = False) -> bool:
    """The shapes the w8g kernel takes: N a multiple of 16, K of 32, the group 16 (without offsets) or a multiple
    of 32 dividing K."""
    return out_features % TILE_N == 0 and in_features % BLOCK_K == 0 and (
        (group_size == 16 and not offsets) or (group_size % BLOCK_K == 0 and in_features % group_size == 0))


def pack_w8g(q: torch.Tensor, scale: torch.Tensor,
             offset: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """The w8g kernel's layout of a grouped int8 weight (``q`` int8 ``[N, K]``, ``scale`` and optional ``offset``
    fp32 ``[N, G]``, G > 1): (wu uint8 ``[N/16, K/4, 16, 4]`` holding q + 128, ws and wo fp32 ``[N/16, G, 16]``,
    the scales and offsets exactly; wo None without offsets)."""
    n, k = q.shape
    g = scale.shape[1]
    if not supports_w8g(n, k, k // g, offset is not None):
        raise ValueError(f"w8g needs out_features % 16 == 0, in_features % 32 == 0 and a group of 16 (no offsets) or "
                         f"a multiple of 32; got N={n}, K={k}, group={k // g}, offsets={offset is not None}")
    return _pack_shifted_int8(q), _by_tile(scale.float()), _by_tile(offset.float()) if offset is not None else None


def w8g_linear(x: torch.Tensor, state: tuple[torch.Tensor, ...], group_size: int, bias: torch.Tensor | None,
               threads: int | None = None, out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """``x [M, K]`` through the native w8g kernel (``state``: ``pack_w8g``'s): ``[M, N]`` in ``out_dtype`` (default
    fp32)."""
    lib = _library()
    assert lib is not None, "native kernels unavailable: check native.available() first"
    wu, ws, wo = state
    m, k = x.shape
    n = wu.shape[0] * TILE_N
    x, y, bias32, out_dtype = _kernel_io(x, n, out_dtype, bias)
    if m:
        rc = lib.specdec_w8g_gemm(x.data_ptr(), int(x.dtype == torch.bfloat16), m, k, wu.data_ptr(), ws.data_ptr(),
                                  _ptr(wo), _ptr(bias32), n, group_size, y.data_ptr(), int(y.dtype == torch.bfloat16),
                                  threads or torch.get_num_threads())
        _check(rc, "w8g", m, k)
    return y.to(out_dtype)


def w8g_reference(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None,
                  offset: torch.Tensor | None = None) -> torch.Tensor:
    """The w8g arithmetic in torch: ``x [M, K]``, ``q`` int8 ``[N, K]``, ``scale`` (and ``offset``) fp32 ``[N, G]``
    (group 16 or a multiple of 32; offsets with the latter); fp32 ``[M, N]``. Piece dots are exact; the kernel's
    fused multiply-adds round once per piece where this sums in fp64, so compare with a tolerance."""
    n, k = q.shape
    group = k // scale.shape[1]
    piece = 16 if group == 16 else BLOCK_K
    xq, xs, xsum = quantize_activations(x)  # (M, B, 32), (M, B), (M, B)
    m = x.shape[0]
    pieces = k // piece
    xp = xq.reshape(m, pieces, piece).double()  # (M, P, piece)
    dots = torch.einsum("mpk,npk->mnp", xp, q.double().reshape(n, pieces, piece))  # (M, N, P) exact
    s = scale.float().repeat_interleave(group // piece, 1) if group > piece else scale.float()  # (N, P)
    xs_p = xs.repeat_interleave(BLOCK_K // piece, 1)  # (M, P)
    terms = dots * (s[None] * xs_p[:, None, :]).double()
    if offset is not None:  # per block of 32 (offsets come with groups of 32k): o * xs * sum of the block's xq
        o = offset.float().repeat_interleave(group // BLOCK_K, 1)  # (N, B)
        terms = terms + o[None].double() * xsum[:, None, :].double()
    out = terms.sum(-1).float()
    return out + bias.float() if bias is not None else out
