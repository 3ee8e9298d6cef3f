"""KV compaction: move K/V rows between cache slots in every layer of a pool, exactly (a bitwise copy).

After tree verification the accepted path's K/V sit at the slots of its tree nodes (written in DFS order, so
with gaps); they must move to the contiguous positions right after the context. One call moves every request's
tokens in every cache tensor of a pool (K and V of all layers):

    kv_compact(caches, src_slots, dst_slots)   (in place)

Semantics: **gather all sources first, then scatter**. A source may be another move's destination (path nodes
[1, 3, 4] move 3 -> 2 and 4 -> 3 in one call): every destination receives the value its source held *before*
the call. Destinations are distinct. A slot is ``block * block_size + offset`` (``BlockManager.slot``).

The Triton path keeps that order across programs with two launches per cache tensor: a gather of the sources
into a workspace ``[L, N, W]`` (``W = Hkv * D``), then a scatter of the workspace to the destinations. Launches
on one stream run in order, so no program of the scatter can overwrite a source before the gather has read it;
within one launch no two programs touch the same element (sources are only read in the gather, destinations
distinct in the scatter). The copy moves raw bits: the caches are viewed as same-width integers, so any dtype
(fp32, fp16, bf16, fp8) is moved exactly and the interpreter's bf16 quirks do not apply.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from specdec.kernels._triton import tl, triton

__all__ = ["kv_compact", "kv_compact_reference", "check_kv_compact_args", "copy_rows_launch"]

_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}  # element size -> integer view dtype
_MAX_BLOCK_W = 1024  # elements of one row per program (a 2 KiB fp16 row of Hkv * D = 1024)
_ELEMENTS_PER_PROGRAM = 4096  # BLOCK_T * BLOCK_W: 16 KiB of fp32 per program, 32 elements per thread at 4 warps


@triton.jit(do_not_specialize=["num_moves"])  # varies every step: no recompiles for N % 16 == 0 or N == 1
def _kv_copy_rows_kernel(
    in_ptr,  # [L, rows_in, W] integer view (a cache or the workspace)
    out_ptr,  # [L, rows_out, W] integer view (the workspace or a cache)
    in_rows_ptr,  # int64 [N] row of `in` for move t (read iff INDEX_IN; else row t)
    out_rows_ptr,  # int64 [N] row of `out` for move t (read iff INDEX_OUT; else row t)
    num_moves,
    row_width,  # W
    stride_in_layer, stride_in_row,
    stride_out_layer, stride_out_row,
    BLOCK_T: tl.constexpr,  # moves per program
    BLOCK_W: tl.constexpr,  # elements of a row per program
    INDEX_IN: tl.constexpr,
    INDEX_OUT: tl.constexpr,
):  # fmt: skip
    """``out[layer, out_row(t), w] = in[layer, in_row(t), w]`` for this program's tile of moves and columns."""
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)  # [BLOCK_T] move indices
    layer = tl.program_id(1).to(tl.int64)
    w = tl.program_id(2) * BLOCK_W + tl.arange(0, BLOCK_W)  # [BLOCK_W] columns
    t_ok = t < num_moves
    if INDEX_IN:
        in_row = tl.load(in_rows_ptr + t, mask=t_ok, other=0).to(tl.int64)
    else:
        in_row = t.to(tl.int64)
    if INDEX_OUT:
        out_row = tl.load(out_rows_ptr + t, mask=t_ok, other=0).to(tl.int64)
    else:
        out_row = t.to(tl.int64)
    ok = t_ok[:, None] & (w < row_width)[None, :]  # [BLOCK_T, BLOCK_W]
    src = in_ptr + layer * stride_in_layer + in_row[:, None] * stride_in_row + w[None, :]
    x = tl.load(src, mask=ok, other=0)
    dst = out_ptr + layer * stride_out_layer + out_row[:, None] * stride_out_row + w[None, :]
    tl.store(dst, x, mask=ok)


# ---------------------------------------------------------------------------------------------- reference


def kv_compact_reference(caches: Sequence[torch.Tensor], src_slots: torch.Tensor, dst_slots: torch.Tensor) -> None:
    """Torch reference (and CPU path) of :func:`kv_compact`: per cache, ``index_select`` then ``index_copy_``."""
    check_kv_compact_args(caches, src_slots, dst_slots)
    if src_slots.numel() == 0:
        return
    for cache in caches:
        rows = _rows(cache, as_bits=False)  # [L, S, W] view of the cache (torch's float copies are exact too)
        rows.index_copy_(1, dst_slots, rows.index_select(1, src_slots))  # the select copies: gather first


# ----------------------------------------------------------------------------------------------- launcher


def kv_compact(caches: Sequence[torch.Tensor], src_slots: torch.Tensor, dst_slots: torch.Tensor) -> None:
    """Move K/V rows from ``src_slots`` to ``dst_slots`` in every cache tensor, in place (Triton).

    Args:
        caches: the pool's cache tensors, all of one shape, dtype and device, contiguous, each
            ``[..., num_blocks, block_size, Hkv, D]``: the pool's ``(k, v)`` pair (``[L, num_blocks, block_size,
            Hkv, D]`` each, ``KVPool.tensors``) or one ``[num_blocks, block_size, Hkv, D]`` tensor per layer and
            K/V. Every leading index (layer) is moved. Distinct tensors.
        src_slots: int64 ``[N]`` flat slots (``block * block_size + offset``) to read, all requests of the batch
            concatenated.
        dst_slots: int64 ``[N]`` flat slots to write, distinct; move t copies slot ``src_slots[t]`` to
            ``dst_slots[t]``, every source read before any destination is written.

    Raises ValueError on bad shapes, dtypes or devices; slot values (range, distinct destinations) are checked
    when the slots are on the CPU (on CUDA that would need a host sync: the engine builds them from the block
    manager, in range by construction). Two launches per cache tensor (gather into a workspace, then scatter).
    """
    check_kv_compact_args(caches, src_slots, dst_slots)
    if src_slots.numel() == 0:
        return
    first = _rows(caches[0])
    workspace = torch.empty((first.shape[0], src_slots.numel(), first.shape[2]), dtype=first.dtype,
                            device=first.device)  # [L, N, W], reused by every cache (launches run in order)
    for cache in caches:
        rows = _rows(cache)
        for grid, args, constexprs, num_warps in (copy_rows_launch(rows, workspace, src_slots, None),
                                                  copy_rows_launch(workspace, rows, None, dst_slots)):
            _kv_copy_rows_kernel[grid](**args, **constexprs, num_warps=num_warps)


def copy_rows_launch(
    src: torch.Tensor, dst: torch.Tensor, src_rows: torch.Tensor | None, dst_rows: torch.Tensor | None
) -> tuple[tuple[int, int, int], dict, dict, int]:
    """``(grid, args, constexprs, num_warps)`` of one launch ``dst[:, dst_rows] = src[:, src_rows]`` over
    ``[L, rows, W]`` integer views (rows ``None``: the identity ``0..N-1``). Works on ``meta`` tensors (the
    GPU compile test uses it)."""
    num_layers, _, width = src.shape
    index = src_rows if src_rows is not None else dst_rows
    num_moves = index.shape[0]
    block_w = min(triton.next_power_of_2(width), _MAX_BLOCK_W)
    block_t = min(max(1, _ELEMENTS_PER_PROGRAM // block_w), triton.next_power_of_2(num_moves))
    grid = (triton.cdiv(num_moves, block_t), num_layers, triton.cdiv(width, block_w))
    args = {
        "in_ptr": src, "out_ptr": dst,
        "in_rows_ptr": src_rows if src_rows is not None else index,  # dummies when not indexed
        "out_rows_ptr": dst_rows if dst_rows is not None else index,
        "num_moves": num_moves, "row_width": width,
        "stride_in_layer": src.stride(0), "stride_in_row": src.stride(1),
        "stride_out_layer": dst.stride(0), "stride_out_row": dst.stride(1),
    }  # fmt: skip
    constexprs = {"BLOCK_T": block_t, "BLOCK_W": block_w,
                  "INDEX_IN": src_rows is not None, "INDEX_OUT": dst_rows is not None}  # fmt: skip
    return grid, args, constexprs, 4


def _rows(cache: torch.Tensor, as_bits: bool = True) -> torch.Tensor:
    """``[L, num_blocks * block_size, Hkv * D]`` view of a contiguous cache (L = 1 for a 4-D one), as same-width
    integers if ``as_bits``."""
    *lead, num_blocks, block_size, num_kv_heads, head_dim = cache.shape
    layers = 1
    for n in lead:
        layers *= n
    view = cache.view(_BITS[cache.element_size()]) if as_bits else cache
    return view.view(layers, num_blocks * block_size, num_kv_heads * head_dim)


# --------------------------------------------------------------------------------------------- validation


def check_kv_compact_args(caches: Sequence[torch.Tensor], src_slots: torch.Tensor, dst_slots: torch.Tensor) -> None:
    """Raise ValueError on anything the kernel would misread or that would corrupt the caches."""
    if isinstance(caches, torch.Tensor) or not isinstance(caches, Sequence) or len(caches) == 0:
        raise ValueError("caches must be a non-empty list/tuple of cache tensors (e.g. KVPool.tensors)")
    first = caches[0]
    for i, cache in enumerate(caches):
        if not isinstance(cache, torch.Tensor):
            raise ValueError(f"caches[{i}] must be a torch.Tensor, got {type(cache).__name__}")
        if cache.ndim < 4:
            raise ValueError(f"caches[{i}] must be [..., num_blocks, block_size, Hkv, D], got shape "
                             f"{tuple(cache.shape)}")  # fmt: skip
        if cache.shape != first.shape or cache.dtype != first.dtype or cache.device != first.device:
            raise ValueError(f"every cache must have caches[0]'s shape, dtype and device "
                             f"({tuple(first.shape)}, {first.dtype}, {first.device}); caches[{i}] has "
                             f"({tuple(cache.shape)}, {cache.dtype}, {cache.device})")  # fmt: skip
        if not cache.is_contiguous():
            raise ValueError(f"caches[{i}] must be contiguous")
        if cache.element_size() not in _BITS:
            raise ValueError(f"caches[{i}] has an unsupported element size {cache.element_size()}")
    if first.device.type != "meta" and len({c.data_ptr() for c in caches}) != len(caches):
        raise ValueError("caches holds the same tensor twice: it would be compacted twice (wrong values)")
    for name, slots in (("src_slots", src_slots), ("dst_slots", dst_slots)):
        if not isinstance(slots, torch.Tensor):
            raise ValueError(f"{name} must be a torch.Tensor, got {type(slots).__name__}")
        if slots.dtype != torch.int64 or slots.ndim != 1 or not slots.is_contiguous():
            raise ValueError(f"{name} must be a contiguous 1-d int64 tensor, got {slots.dtype} of shape "
                             f"{tuple(slots.shape)}")  # fmt: skip
        if slots.device != first.device:
            raise ValueError(f"{name} is on {slots.device} but the caches are on {first.device}")
    if src_slots.shape != dst_slots.shape:
        raise ValueError(f"src_slots and dst_slots must have equal lengths, got {src_slots.numel()} and "
                         f"{dst_slots.numel()}")  # fmt: skip
    if first.device.type == "cpu" and src_slots.numel():
        num_slots = first.shape[-4] * first.shape[-3]
        # NOTE: on Python lists: N is small (accepted drafts of one batch), and a handful of torch ops on it (min,
        # max, unique) cost more than the moves themselves.
        values = {"src_slots": src_slots.tolist(), "dst_slots": dst_slots.tolist()}
        for name, slots in values.items():
            lo, hi = min(slots), max(slots)
            if lo < 0 or hi >= num_slots:
                raise ValueError(f"{name} must lie in [0, num_blocks * block_size = {num_slots}), got values in "
                                 f"[{lo}, {hi}]")  # fmt: skip
        if len(set(values["dst_slots"])) != len(values["dst_slots"]):
            raise ValueError("dst_slots must be distinct (two moves into one slot)")
