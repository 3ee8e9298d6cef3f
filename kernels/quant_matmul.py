"""Weight-only quantised matmul ``y = x @ dequant(W).T (+ bias)`` for 1..16 rows (and more), int8 / int4.

The GPU path of ``QuantizedLinear`` (specdec/model/quant/linear.py). The weight formats are those of
specdec/model/quant/formats.py: ``value = q * scale[n, k // GROUP] (+ offset[...])``, int8 ``[N, K]`` or int4 packed
two per byte ``[N, K // 2]`` (column 2j low nibble), fp32 scales / offsets ``[N, K // GROUP]`` (per-channel int8 is
``GROUP == K``).

Design (the small-M weight-only GEMV/GEMM of GemLite / Marlin / gpt-fast's int4 path, in our formats):

- Scale after the dot. The integer weights (int8 in [-127, 127], int4 in [0, 15]) are exact in bf16 / fp16, and so
  are the activations, so ``tl.dot(x_half, q_half)`` on tensor cores gives exact products with fp32 accumulation.
  Each dot covers one sub-tile of K that lies inside one quantisation group, so the group's fp32 scale multiplies the
  dot's fp32 partial and the offset enters as ``offset * (sum of x over the sub-tile)``:
  ``sum_k x_k (q_k s + o) = s * sum_k x_k q_k + o * sum_k x_k``. Per-channel scales (one group) multiply the whole
  sum once at the end. fp32 inputs take the same path with ``input_precision="ieee"`` dots (no tf32).
- int4: a byte tile ``[BLOCK_N, SUB // 2]`` is split into low / high nibbles and ``tl.interleave``d back into K
  order in registers, so x is read contiguously and each sub-tile is one dot.
- Split-K with a deterministic reduction, so that a 3072-wide linear has enough programs to keep the GPU's memory
  busy: program ``(n tile, split, 16-row block)`` walks ``K_PER_SPLIT`` columns and writes its fp32 partial to
  ``[SPLIT, M, N]``; ``_split_k_reduce_kernel`` sums the splits in a fixed order, adds the bias and casts. No atomics.
  With one split the main kernel writes the output itself.
- Row independence (speculative decoding: a row's result is the same in a decode and in a k+1-row window): every
  choice - tiles, sub-tiles, split count - depends on N, K, bits, group and the device's SM count, never on M;
  BLOCK_M is always 16 (tl.dot's smallest M) and a dot's output row depends only on its own input row.

``quant_matmul_reference`` is the torch reference: dequantise to fp32, matmul in fp32 - the same arithmetic up to
the order of the sums and where the scale is applied (fp32 rounding: ~1e-6 relative; tests allow 1e-5 in fp32 and
one rounding of the output dtype for bf16 / fp16).

NOTE: no autotuning (STYLE.md 8): fixed tiles chosen by shape in ``quant_matmul_config``, checked for spills and
shared memory by tests/kernels/test_gpu_compile_quant_matmul.py. Measured on a GPU (H200, the third GPU run:
bench/results/gpu_h200_20261126_run3/README.md): only the previous design (one program per 16 x 64 outputs
walking all of K with fp32 dequantisation and ``ieee`` dots: correct, 2-7% of bf16 cuBLAS's speed). This
redesign has NOT been run on a GPU yet: interpreter tests and sm_80 / sm_90 compile checks only; its speed is
unmeasured.

Over 300 lines because the Triton kernel, its launcher and its torch reference (the CPU path and the test oracle)
stay side by side, as every kernel's do.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import torch

from specdec.kernels._triton import tl, triton

BLOCK_M, BLOCK_N = 16, 64
# K columns one loop iteration reads per weight row (int8: a 128-byte line; int4: 64 bytes, see the config).
_BASE_K = {8: 128, 4: 128}
# fp32 inputs: ``ieee`` dots are FMA loops with both operands in registers; 128 columns spilled hundreds of bytes on
# sm_80 / sm_90, 32 with 8 warps does not (a rare, correctness-first case).
_BASE_K_FP32 = {8: 32, 4: 32}
_MIN_SUB = 16  # tl.dot needs K >= 16
_PROGRAMS_PER_SM = 2  # split K until there are this many programs per SM (each keeps num_stages tiles in flight)
_MIN_TILES_PER_SPLIT = 2  # a split shorter than this is all prologue (x and scale loads, partial store)
_MAX_SPLIT = 16
_DEFAULT_NUM_SMS = 132  # H100 / H200; only where no CUDA device is there to ask (interpreter, meta tensors)


@triton.jit(do_not_specialize=["M"])  # the row count changes every step (decode, k+1 windows)
def _quant_matmul_kernel(
    x_ptr, w_ptr, scale_ptr, offset_ptr, bias_ptr, out_ptr, part_ptr,
    M, N, K, K_PER_SPLIT,
    stride_xm, stride_wn, stride_sn, stride_om,
    GROUP: tl.constexpr, BITS: tl.constexpr, HAS_OFFSET: tl.constexpr, HAS_BIAS: tl.constexpr,
    PER_CHANNEL: tl.constexpr,  # one group per row: scale (and offset) applied once, after the whole sum
    SPLIT: tl.constexpr,  # False: write out (+ bias); True: write the fp32 partial to part_ptr [SPLIT, M, N]
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    STEP: tl.constexpr,  # K columns per sub-tile (divides GROUP unless PER_CHANNEL; even for int4)
    SUB: tl.constexpr,  # power of two >= STEP: the sub-tile's arange (columns past STEP are masked)
    TILES: tl.constexpr,  # sub-tiles per loop iteration (BLOCK_K = TILES * STEP divides K_PER_SPLIT)
    DOT_F32: tl.constexpr,  # upcast to fp32 before tl.dot (the interpreter's bf16 dot is wrong)
    DOT_PRECISION: tl.constexpr,  # "ieee" for fp32 (no tf32) and DOT_F32; None: the tensor-core default
):  # fmt: skip
    pid_n = tl.program_id(0).to(tl.int64)
    pid_s = tl.program_id(1).to(tl.int64)
    pid_m = tl.program_id(2).to(tl.int64)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)  # (BLOCK_M,)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)  # (BLOCK_N,)
    m_mask = rm < M
    n_mask = rn < N
    x_rows = x_ptr + rm[:, None] * stride_xm  # (BLOCK_M, 1)
    w_rows = w_ptr + rn[:, None] * stride_wn  # (BLOCK_N, 1)
    k_start = pid_s * K_PER_SPLIT
    k_end = tl.minimum(k_start + K_PER_SPLIT, K)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    row_sum = tl.zeros((BLOCK_M,), dtype=tl.float32)  # per-channel offsets only
    for k0 in range(k_start, k_end, TILES * STEP):
        for t in tl.static_range(TILES):
            kb = k0 + t * STEP  # first column of the sub-tile (inside one group)
            j = tl.arange(0, SUB)  # (SUB,)
            k_ok = (j < STEP) & (kb + j < K)
            x = tl.load(x_rows + (kb + j)[None, :], mask=m_mask[:, None] & k_ok[None, :], other=0.0)  # (BM, SUB)
            if BITS == 8:
                q = tl.load(w_rows + (kb + j)[None, :], mask=n_mask[:, None] & k_ok[None, :], other=0)  # (BN, SUB)
            else:
                jb = tl.arange(0, SUB // 2)  # (SUB // 2,) byte columns: column kb + 2 jb is the low nibble
                b_ok = (jb < STEP // 2) & (kb + 2 * jb < K)
                byte = tl.load(w_rows + (kb // 2 + jb)[None, :], mask=n_mask[:, None] & b_ok[None, :], other=0)
                byte = byte.to(tl.int32)  # (BN, SUB // 2)
                q = tl.interleave(byte & 0xF, byte >> 4)  # (BN, SUB) in K order
            if DOT_F32:
                x = x.to(tl.float32)
            part = tl.dot(x, tl.trans(q.to(x.dtype)), input_precision=DOT_PRECISION)  # (BM, BN) fp32
            xs = tl.sum(x.to(tl.float32), axis=1)  # (BM,) the offset's row sum
            if PER_CHANNEL:
                acc += part
                if HAS_OFFSET:
                    row_sum += xs
            else:
                s_mask = tl.where(kb < K, n_mask, False)
                s_off = rn * stride_sn + kb // GROUP  # (BN,)
                acc += part * tl.load(scale_ptr + s_off, mask=s_mask, other=0.0)[None, :]
                if HAS_OFFSET:
                    acc += xs[:, None] * tl.load(offset_ptr + s_off, mask=s_mask, other=0.0)[None, :]
    if PER_CHANNEL:
        acc = acc * tl.load(scale_ptr + rn * stride_sn, mask=n_mask, other=0.0)[None, :]
        if HAS_OFFSET:
            acc += row_sum[:, None] * tl.load(offset_ptr + rn * stride_sn, mask=n_mask, other=0.0)[None, :]
    out_mask = m_mask[:, None] & n_mask[None, :]
    if SPLIT:
        tl.store(part_ptr + (pid_s * M + rm[:, None]) * N + rn[None, :], acc, mask=out_mask)
    else:
        if HAS_BIAS:
            acc += tl.load(bias_ptr + rn, mask=n_mask, other=0.0).to(tl.float32)[None, :]
        tl.store(out_ptr + rm[:, None] * stride_om + rn[None, :], acc.to(out_ptr.dtype.element_ty), mask=out_mask)


@triton.jit(do_not_specialize=["M"])
def _split_k_reduce_kernel(part_ptr, bias_ptr, out_ptr, M, N, NUM_SPLITS, stride_om,
                           HAS_BIAS: tl.constexpr, BLOCK: tl.constexpr):  # fmt: skip
    """``out[m, n] = sum_s part[s, m, n] (+ bias[n])`` summed in split order (deterministic, row-independent)."""
    m = tl.program_id(0).to(tl.int64)
    rn = tl.program_id(1).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)  # (BLOCK,)
    n_mask = rn < N
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for s in range(NUM_SPLITS):
        acc += tl.load(part_ptr + (s * M + m) * N + rn, mask=n_mask, other=0.0)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + rn, mask=n_mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + m * stride_om + rn, acc.to(out_ptr.dtype.element_ty), mask=n_mask)


_REDUCE_BLOCK = 1024
# Triton decides at decoration time whether a jit function is compiled or interpreted (TRITON_INTERPRET).
_INTERPRETED = not isinstance(_quant_matmul_kernel, triton.runtime.JITFunction)


class QuantConfig(NamedTuple):
    """Tiles of one weight shape (a function of N, K, bits, group and the SM count - never of M)."""

    step: int  # K columns per sub-tile, inside one group
    sub: int  # power of two >= step
    tiles: int  # sub-tiles per loop iteration; block_k = tiles * step
    split: int  # K splits
    k_per_split: int  # a multiple of block_k
    num_warps: int
    num_stages: int


def quant_matmul_config(n: int, k: int, bits: int, group: int, num_sms: int, fp32: bool = False) -> QuantConfig:
    """The fixed configuration for an ``[N, K]`` weight with ``bits`` and ``group`` (== K: per channel), for fp16 /
    bf16 activations (``fp32``: fp32 activations).

    Sub-tiles: per channel, 128 columns per iteration (fp32: 32); a group that is at most that is one sub-tile (padded
    to a power of two, at least 16), repeated to fill the iteration; a larger group is cut into equal sub-tiles of at
    most that (even for int4: whole bytes). 128 int8 columns are a 128-byte line per weight row; int4 stays at 128
    columns (64 bytes) because 256 took 255 registers and spilled on sm_90. Split K: the fewest splits giving
    ``_PROGRAMS_PER_SM * num_sms`` programs (n tiles x splits), at least ``_MIN_TILES_PER_SPLIT`` iterations per
    split, at most ``_MAX_SPLIT``. fp32 runs 8 warps (4 spilled with ``ieee`` dots)."""
    base, unit = (_BASE_K_FP32 if fp32 else _BASE_K)[bits], (1 if bits == 8 else 2)  # int4: steps of whole bytes
    if group == k:  # per channel
        step, tiles = base, 1
    elif group <= base:
        step = group
        tiles = max(1, base // triton.next_power_of_2(max(group, _MIN_SUB)))
    else:
        units = group // unit
        d = next(d for d in range(-(-group // base), units + 1) if units % d == 0)
        step, tiles = group // d, 1
    sub = max(_MIN_SUB, triton.next_power_of_2(step))
    block_k = tiles * step
    k_iters = triton.cdiv(k, block_k)
    want = triton.cdiv(_PROGRAMS_PER_SM * num_sms, triton.cdiv(n, BLOCK_N))
    split = max(1, min(want, k_iters // _MIN_TILES_PER_SPLIT, _MAX_SPLIT))
    iters_per_split = triton.cdiv(k_iters, split)
    split = triton.cdiv(k_iters, iters_per_split)  # no empty split
    return QuantConfig(step, sub, tiles, split, iters_per_split * block_k, num_warps=8 if fp32 else 4, num_stages=3)


@functools.cache
def _num_sms(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


class LaunchPlan(NamedTuple):
    """What one call launches; :func:`quant_matmul` runs it and the GPU compile test compiles it."""

    grid: tuple[int, int, int]  # (n tiles, splits, 16-row blocks)
    args: dict  # every non-constexpr argument of _quant_matmul_kernel, by name
    constexprs: dict
    num_warps: int
    num_stages: int
    reduce_grid: tuple[int, int] | None  # None with one split
    reduce_args: dict | None
    reduce_constexprs: dict | None


def quant_matmul(x: torch.Tensor, qweight: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor | None,
                 bias: torch.Tensor | None, bits: int, config: QuantConfig | None = None) -> torch.Tensor:
    """``x @ dequant(W).T + bias`` (Triton).

    Args:
        x: ``[M, K]`` fp32 / bf16 / fp16, rows contiguous.
        qweight: int8 ``[N, K]`` (bits 8) or uint8 ``[N, K // 2]`` (bits 4, two values per byte), contiguous.
        scale: fp32 ``[N, G]`` with ``K % G == 0`` (group ``K // G``); offset: fp32 ``[N, G]`` or None.
        bias: ``[N]`` or None.
        config: tiles and splits (tests); default ``quant_matmul_config`` for the shape and device.
    Returns ``[M, N]`` in ``x``'s dtype (fp32 accumulation). Raises ValueError on bad shapes / dtypes / devices.
    """
    check_quant_matmul_args(x, qweight, scale, offset, bias, bits)
    out = torch.empty((x.shape[0], scale.shape[0]), dtype=x.dtype, device=x.device)
    if x.shape[0] == 0:
        return out
    plan = quant_matmul_launch(x, qweight, scale, offset, bias, out, bits, config)
    _quant_matmul_kernel[plan.grid](**plan.args, **plan.constexprs, num_warps=plan.num_warps,
                                    num_stages=plan.num_stages)  # fmt: skip
    if plan.reduce_grid is not None:
        _split_k_reduce_kernel[plan.reduce_grid](**plan.reduce_args, **plan.reduce_constexprs, num_warps=4)
    return out


def quant_matmul_launch(x, qweight, scale, offset, bias, out, bits: int, config: QuantConfig | None = None,
                        num_sms: int | None = None, interpret: bool | None = None) -> LaunchPlan:
    """The launches of one call; works on ``meta`` tensors (the GPU compile test passes ``interpret=False``)."""
    m, k = x.shape
    n, groups = scale.shape
    if num_sms is None:
        num_sms = _num_sms(x.device.index or 0) if x.device.type == "cuda" else _DEFAULT_NUM_SMS
    cfg = config or quant_matmul_config(n, k, bits, k // groups, num_sms, x.dtype == torch.float32)
    _check_config(cfg, k, k // groups, groups == 1, bits)
    split = cfg.split > 1
    part = torch.empty((cfg.split, m, n), dtype=torch.float32, device=x.device) if split else out  # (SPLIT, M, N)
    args = {
        "x_ptr": x, "w_ptr": qweight, "scale_ptr": scale,
        "offset_ptr": offset if offset is not None else scale,  # dummies when absent
        "bias_ptr": bias if bias is not None else scale, "out_ptr": out, "part_ptr": part,
        "M": m, "N": n, "K": k, "K_PER_SPLIT": cfg.k_per_split,
        "stride_xm": x.stride(0), "stride_wn": qweight.stride(0), "stride_sn": scale.stride(0),
        "stride_om": out.stride(0),
    }  # fmt: skip
    dot_f32 = (_INTERPRETED if interpret is None else interpret) and x.dtype == torch.bfloat16
    constexprs = {"GROUP": k // groups, "BITS": bits, "HAS_OFFSET": offset is not None, "HAS_BIAS": bias is not None,
                  "PER_CHANNEL": groups == 1, "SPLIT": split, "BLOCK_M": BLOCK_M, "BLOCK_N": BLOCK_N,
                  "STEP": cfg.step, "SUB": cfg.sub, "TILES": cfg.tiles, "DOT_F32": dot_f32,
                  # fp32 means fp32: tl.dot's default on a GPU is tf32 (10-bit mantissa operands)
                  "DOT_PRECISION": "ieee" if x.dtype == torch.float32 or dot_f32 else None}  # fmt: skip
    grid = (triton.cdiv(n, BLOCK_N), cfg.split, triton.cdiv(m, BLOCK_M))
    reduce = (None, None, None)
    if split:
        reduce = ((m, triton.cdiv(n, _REDUCE_BLOCK)),
                  {"part_ptr": part, "bias_ptr": args["bias_ptr"], "out_ptr": out, "M": m, "N": n,
                   "NUM_SPLITS": cfg.split, "stride_om": out.stride(0)},
                  {"HAS_BIAS": bias is not None, "BLOCK": _REDUCE_BLOCK})  # fmt: skip
    return LaunchPlan(grid, args, constexprs, cfg.num_warps, cfg.num_stages, *reduce)


def _check_config(cfg: QuantConfig, k: int, group: int, per_channel: bool, bits: int) -> None:
    """ValueError on a configuration the kernel would compute wrongly with (one passed in by a test)."""
    block_k = cfg.tiles * cfg.step
    ok = (cfg.sub >= max(cfg.step, _MIN_SUB) and cfg.sub & (cfg.sub - 1) == 0 and cfg.k_per_split % block_k == 0
          and cfg.split * cfg.k_per_split >= k and (per_channel or group % cfg.step == 0)
          and (bits == 8 or cfg.step % 2 == 0))  # fmt: skip
    if not ok:
        raise ValueError(f"config {cfg} does not fit K={k}, group={group}, bits={bits}")


def quant_matmul_reference(x: torch.Tensor, qweight: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor | None,
                           bias: torch.Tensor | None, bits: int) -> torch.Tensor:
    """The weight-only arithmetic in torch (same arguments as ``quant_matmul``): dequantise to fp32
    (specdec/model/quant/formats.py), ``x.float() @ W.T`` in fp32, ``+ bias``, cast to ``x``'s dtype.

    NOTE: one row at a time: a CPU GEMM picks its kernel (and so its order of sums) by the number of rows, which
    would make a row's result depend on how many rows came with it (decode vs verification window)."""
    w_t = dequantize(qweight, scale, offset, bits).T  # (K, N) fp32
    x32 = x.float()
    out = torch.cat([x32[i : i + 1] @ w_t for i in range(x32.shape[0])]) if x32.shape[0] else x32 @ w_t  # (M, N)
    if bias is not None:
        out = out + bias.float()
    return out.to(x.dtype)


def unpack_int4(packed: torch.Tensor) -> torch.Tensor:
    """uint8 ``[N, K // 2]`` -> uint8 ``[N, K]`` values in [0, 15] (column 2j from the low nibble, 2j+1 the high)."""
    n, half = packed.shape
    return torch.stack([packed & 0xF, packed >> 4], dim=-1).reshape(n, 2 * half)


def dequantize(q: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor | None, bits: int) -> torch.Tensor:
    """fp32 ``[N, K]`` of a quantised weight (``q`` int8 ``[N, K]`` for 8 bits, packed uint8 ``[N, K // 2]`` for 4;
    ``scale`` / ``offset`` fp32 ``[N, G]``): ``q * scale`` then ``+ offset``, each rounded to fp32 (the order of
    ``gguf.quants``' dequantisation, so kept GGUF blocks dequantise bit-exactly as gguf's do)."""
    values = (unpack_int4(q) if bits == 4 else q).float()  # (N, K)
    n, k = values.shape
    g = k // scale.shape[1]
    w = (values.view(n, -1, g) * scale[..., None].float()).view(n, k)  # (N, K)
    if offset is not None:
        w = (w.view(n, -1, g) + offset[..., None].float()).view(n, k)
    return w


def check_quant_matmul_args(x, qweight, scale, offset, bias, bits: int) -> None:
    """Raise ValueError on anything the kernel would misread."""
    if bits not in (4, 8):
        raise ValueError(f"bits must be 4 or 8, got {bits!r}")
    if x.dim() != 2 or x.stride(1) != 1 or x.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise ValueError(f"x must be a row-contiguous fp32/bf16/fp16 [M, K] tensor, got {x.dtype} {tuple(x.shape)}")
    k = x.shape[1]
    n = scale.shape[0]
    want = (n, k) if bits == 8 else (n, k // 2)
    wdtype = torch.int8 if bits == 8 else torch.uint8
    if tuple(qweight.shape) != want or qweight.dtype != wdtype or not qweight.is_contiguous():
        raise ValueError(f"qweight must be a contiguous {wdtype} {want}, got {qweight.dtype} {tuple(qweight.shape)}")
    if scale.dim() != 2 or scale.dtype != torch.float32 or not scale.is_contiguous() or k % scale.shape[1]:
        raise ValueError(f"scale must be a contiguous fp32 [N, G] with K={k} divisible by G, got {tuple(scale.shape)}")
    if offset is not None and (offset.shape != scale.shape or offset.dtype != torch.float32
                               or not offset.is_contiguous()):
        raise ValueError("offset must be None or a contiguous fp32 tensor shaped like scale")
    if bias is not None and (tuple(bias.shape) != (n,) or not bias.is_contiguous()):
        raise ValueError(f"bias must be None or a contiguous [{n}] tensor")
    tensors = [t for t in (x, qweight, scale, offset, bias) if t is not None]
    if len({t.device for t in tensors}) != 1:
        raise ValueError("x, qweight, scale, offset and bias must be on one device")
