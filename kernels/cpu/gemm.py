"""Row-invariant bf16 GEMMs for CPUs (C, built at first use): ``gemm_bf16(x, packed)`` computes ``x @ W^T`` for
``x [M, K]`` bf16 so that each output row is the same bit for bit whatever ``M`` is and whatever the thread count.

Two kernels, one per instruction set, the same packed weight:

- ``gemm_amx.c`` (AMX-BF16, Sapphire Rapids and later): one fp32 accumulator per output fed a 32-input chunk at a
  time by ``tdpbf16ps``, chunks in order. Measured against oneDNN's prepacked bf16 linear (what a bf16 ``Linear``
  ran before) on SmolLM2 / Qwen2.5-0.5B shapes, 1 thread: 1.0-1.7x faster at 1-8 rows, 0.9-1.1x at 40, 0.6-1.1x at
  512 (``bench/experiments/20261128_invariant``). The hardware's order of additions inside a chunk is its own (no
  simple sequential model reproduces it), so its reference is a tolerance against exact sums.
- ``gemm_bf16.c`` (AVX512_BF16 without AMX: Cooper Lake, Zen 4): two fp32 accumulators per output fed alternate pairs
  of inputs by ``vdpbf16ps``, spelled out in the source and repeated bit for bit by ``gemm_bf16_reference``. Faster
  than oneDNN at one row, 0.5-0.8x at 5-8 rows on this CPU (it has no tile unit).

Both read each weight once for many rows, so a verification window costs about what a decode does.
"""

from __future__ import annotations

import ctypes
import functools
from pathlib import Path

import torch

from specdec.kernels.cpu.build import build_library, cpu_flags

HERE = Path(__file__).parent
COMMON_FLAGS = ["-O3", "-ffp-contract=off", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512bf16", "-fopenmp",
                "-fPIC", "-shared"]
TILE_N = 16  # outputs per tile (both kernels)
CHUNK_K = 32  # the packed weight's K is padded to a multiple of this (AMX's chunk)
CHAINS = 2  # fp32 accumulators per output in gemm_bf16.c
_LOST = "bf16 linears use oneDNN, whose rounding changes with the number of rows"


@functools.cache
def _amx() -> ctypes.CDLL | None:
    if not {"avx512f", "avx512bw", "avx512vl", "avx512_bf16", "amx_tile", "amx_bf16"} <= cpu_flags():
        return None
    lib = build_library("specdec_gemm_amx", [HERE / "gemm_amx.c"], [HERE / "bf16.h"],
                        COMMON_FLAGS + ["-mamx-tile", "-mamx-bf16"],
                        _LOST)
    if lib is None:
        return None
    ptr, i64 = ctypes.c_void_p, ctypes.c_int64
    lib.specdec_gemm_amx.argtypes = [ptr, i64, i64, i64, ptr, ptr, i64, ptr, ctypes.c_int, ctypes.c_int]
    lib.specdec_gemm_amx.restype = ctypes.c_int
    return lib if lib.specdec_amx_init() == 0 else None


@functools.cache
def _avx512_bf16() -> ctypes.CDLL | None:
    if not {"avx512f", "avx512bw", "avx512vl", "avx512_bf16"} <= cpu_flags():
        return None
    lib = build_library("specdec_gemm_bf16", [HERE / "gemm_bf16.c"], [HERE / "bf16.h"], COMMON_FLAGS, _LOST)
    if lib is None:
        return None
    ptr, i64 = ctypes.c_void_p, ctypes.c_int64
    lib.specdec_gemm_bf16.argtypes = [ptr, i64, i64, ptr, ptr, i64, ptr, ctypes.c_int, ctypes.c_int]
    lib.specdec_gemm_bf16.restype = None
    return lib


def backend() -> str | None:
    """``"amx"`` or ``"avx512_bf16"``: the kernel ``gemm_bf16`` runs on this CPU; None where neither builds and runs
    (no such instructions, no C compiler, ``SPECDEC_NATIVE=0``)."""
    if _amx() is not None:
        return "amx"
    return "avx512_bf16" if _avx512_bf16() is not None else None


def available() -> bool:
    """True where a row-invariant bf16 GEMM runs here."""
    return backend() is not None


def pack_bf16(weight: torch.Tensor) -> torch.Tensor:
    """The kernels' layout of ``weight [N, K]`` (any float dtype; rounded to bf16): bf16 ``[ceil(N/16), Kp/2, 16,
    2]`` (tile, pair, lane, b) = ``W[16 tile + lane, 2 pair + b]``, Kp = K rounded up to 32, zeros in the padding."""
    n, k = weight.shape
    tiles, kp = -(-n // TILE_N), -(-k // CHUNK_K) * CHUNK_K
    w = weight.detach().to(torch.bfloat16)
    if tiles * TILE_N != n or kp != k:
        w = torch.nn.functional.pad(w, (0, kp - k, 0, tiles * TILE_N - n))
    return w.reshape(tiles, TILE_N, kp // 2, 2).permute(0, 2, 1, 3).contiguous()  # (tile, pair, lane, b)


def gemm_bf16(x: torch.Tensor, packed: torch.Tensor, out_features: int, bias: torch.Tensor | None = None,
              out_dtype: torch.dtype = torch.bfloat16, threads: int | None = None,
              kernel: str | None = None) -> torch.Tensor:
    """``x [M, K]`` (bf16; other dtypes are rounded to bf16) times a ``pack_bf16`` weight: ``[M, out_features]`` in
    ``out_dtype`` (bf16 or fp32), with ``bias`` (``[N]``, any float dtype) added in fp32 before the one rounding.
    Row m of the result depends on row m of ``x`` only, bit for bit. ``kernel``: "amx" or "avx512_bf16" to pick
    one (tests); None: ``backend()``."""
    if out_dtype not in (torch.bfloat16, torch.float32):
        raise ValueError(f"gemm_bf16 writes bf16 or fp32, not {out_dtype}")
    x = x.to(torch.bfloat16).contiguous()
    m, k = x.shape
    kp = packed.shape[1] * 2
    if not k <= kp < k + CHUNK_K:
        raise ValueError(f"x has {k} features; the packed weight was made for {kp} (padded to a multiple of 32)")
    if not 0 < out_features <= packed.shape[0] * TILE_N:
        raise ValueError(f"out_features={out_features}, but the packed weight holds {packed.shape[0] * TILE_N} rows")
    y = torch.empty(m, out_features, dtype=out_dtype)
    if m == 0:
        return y
    bias32 = bias.float().contiguous() if bias is not None else None
    bias_ptr = None if bias32 is None else bias32.data_ptr()
    threads = threads or torch.get_num_threads()
    kernel = kernel or backend()
    if kernel not in ("amx", "avx512_bf16") or (_amx() if kernel == "amx" else _avx512_bf16()) is None:
        raise RuntimeError(f"the row-invariant bf16 GEMM {kernel!r} does not run on this CPU: check gemm.available()")
    if kernel == "amx" and (amx := _amx()) is not None:
        rc = amx.specdec_gemm_amx(x.data_ptr(), m, k, kp, packed.data_ptr(), bias_ptr, out_features, y.data_ptr(),
                                  int(out_dtype == torch.bfloat16), threads)
        if rc != 0:
            raise MemoryError(f"gemm_amx: could not allocate a padded copy of {m} x {k} activations")
        return y
    lib = _avx512_bf16()
    if kp != k:
        x = torch.nn.functional.pad(x, (0, kp - k))
    lib.specdec_gemm_bf16(x.data_ptr(), m, kp, packed.data_ptr(), bias_ptr, out_features, y.data_ptr(),
                          int(out_dtype == torch.bfloat16), threads)
    return y


def gemm_bf16_reference(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                        out_dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """``gemm_bf16.c``'s arithmetic in torch, bit for bit for inputs and partial sums that are not denormal (the
    kernel flushes those to zero): ``x [M, K]`` and ``weight [N, K]`` rounded to bf16; ``[M, N]`` in ``out_dtype``.
    For the AMX kernel it is a close approximation (the same products and chunks, another order of additions)."""
    xb = x.to(torch.bfloat16).float()  # (M, K)
    wb = weight.to(torch.bfloat16).float()  # (N, K)
    m, k = xb.shape
    acc = torch.zeros(CHAINS, m, wb.shape[0])  # (chain, M, N) fp32
    for c in range(k // 2):
        j = c % CHAINS
        acc[j] = acc[j] + xb[:, 2 * c + 1, None] * wb[None, :, 2 * c + 1]  # products of bf16s are exact in fp32
        acc[j] = acc[j] + xb[:, 2 * c, None] * wb[None, :, 2 * c]
    out = acc[0]
    for j in range(1, CHAINS):
        out = out + acc[j]
    if bias is not None:
        out = out + bias.float()
    return out.to(out_dtype)
