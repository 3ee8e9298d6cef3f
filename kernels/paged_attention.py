"""Paged attention over a block-table KV cache: decode, multi-token verification (causal) and tree masks.

Signature (the attention contract, docs/architecture.md):
    paged_attention(q, k_cache, v_cache, block_tables, seq_lens, cu_q_lens, scale,
                    tree_mask=None, tree_mask_indptr=None) -> out

The Triton kernel follows the "unified attention" layout: one program owns one KV head of one sequence and a
tile of ``BLOCK_Q`` new tokens; the ``GROUP = Hq // Hkv`` query heads that share the KV head times those tokens
form the ``BLOCK_M`` rows of the score tile, so every K/V tile is read once per GQA group and ``tl.dot`` gets
M >= 16 even for decode. Keys are gathered token by token through the block table (any block size, blocks in
any physical order). When there are too few (q tile, KV head) programs to fill the GPU, each program's KV range
is split over several programs (flash-decoding) and a second kernel merges their partial softmaxes: the fewest
splits that give one wave of CTAs on the GPU's SMs, none shorter than 32 keys (``num_kv_splits``).

Precision: fp32 inputs mean fp32 math. Both dots (Q @ K^T and P @ V) pass ``input_precision=DOT_PRECISION``, which
the launcher sets to ``"ieee"`` for fp32 operands; Triton's default on a GPU is tf32 (operands rounded to a 10-bit
mantissa, ~1e-3 relative error). IEEE fp32 dots run on the FMA units, not tensor cores, so an fp32 launch is
slower than a half-precision one; fp32 is the exactness path (tests, debugging), not the fast one. fp16/bf16
dots are unchanged (``DOT_PRECISION=None``: tensor cores, fp32 accumulation).

Over 300 lines because the decode, prefill and tree-mask variants share one launcher and one block-table layout, and
their torch reference (the CPU path and the test oracle) stays beside them.
"""

import functools
import math
from typing import NamedTuple

import torch

from specdec.kernels._triton import tl, triton
from specdec.kernels.paged_attention_reference import paged_attention_reference

__all__ = ["paged_attention", "paged_attention_reference", "paged_attention_uniform", "launch_plan",
           "attention_configs", "num_kv_splits"]


@triton.jit
def _attend_tile(
    acc, m_i, l_i,  # running state: fp32 [BLOCK_M, HEAD_DIM_PAD], [BLOCK_M], [BLOCK_M]
    q,  # [BLOCK_M, HEAD_DIM_PAD]
    t,  # KV tile: keys t * BLOCK_N + [0, BLOCK_N)
    kv_end, prefix, q_idx, has_tree, tree_start, mask_seq_ptr, mask_rows,
    bt_row, k_head_ptr, v_head_ptr, stride_k_blk, stride_k_tok, stride_v_blk, stride_v_tok,
    offs_d, d_ok, scale_log2,
    BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr,
    TREE: tl.constexpr, MASKED: tl.constexpr, DOT_F32: tl.constexpr, DOT_PRECISION: tl.constexpr,
):  # fmt: skip
    """One online-softmax step over a KV tile; MASKED=False when every key of the tile is visible to every row.
    With TREE, ``has_tree`` (this sequence's mask slice is not empty) picks the tree mask or the causal one."""
    pos = t * BLOCK_N + tl.arange(0, BLOCK_N)  # [BLOCK_N] logical key positions
    pos_ok = pos < kv_end
    blk = tl.load(bt_row + pos // BLOCK_SIZE, mask=pos_ok, other=0).to(tl.int64)  # [BLOCK_N] physical ids
    slot = pos % BLOCK_SIZE
    k_off = blk * stride_k_blk + slot * stride_k_tok  # [BLOCK_N] int64
    k = tl.load(k_head_ptr + k_off[None, :] + offs_d[:, None], mask=d_ok[:, None] & pos_ok[None, :], other=0.0)
    if DOT_F32:
        k = k.to(tl.float32)
    # [BLOCK_M, BLOCK_N] (K loaded transposed: [HEAD_DIM_PAD, BLOCK_N])
    s = tl.dot(q, k, input_precision=DOT_PRECISION) * scale_log2
    if MASKED:
        causal = pos[None, :] <= (prefix + q_idx)[:, None]  # implies pos < kv_end on real rows
        if TREE:
            j = pos - tree_start  # column of the mask (the last w keys); < 0 in the context before them
            # NOTE: tl.where, not `vector & scalar` (rejected by triton 3.9); no mask byte is read when causal.
            in_tree = tl.where(has_tree, pos_ok & (j >= 0), False)
            tm = tl.load(mask_seq_ptr + (mask_rows[:, None] + j[None, :]), mask=in_tree[None, :], other=0)
            tree_visible = ((j < 0)[None, :] | (tm != 0)) & pos_ok[None, :]
            visible = tl.where(has_tree, tree_visible, causal)
        else:
            visible = causal
        s = tl.where(visible, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    # NOTE: a row that has seen no visible key yet keeps m = -inf; shift by 0 there to avoid inf - inf.
    m_shift = tl.where(m_new == float("-inf"), 0.0, m_new)
    p = tl.exp2(s - m_shift[:, None])  # [BLOCK_M, BLOCK_N]
    alpha = tl.exp2(m_i - m_shift)
    l_i = l_i * alpha + tl.sum(p, 1)
    v_off = blk * stride_v_blk + slot * stride_v_tok
    v = tl.load(v_head_ptr + v_off[:, None] + offs_d[None, :], mask=pos_ok[:, None] & d_ok[None, :], other=0.0)
    if DOT_F32:
        acc = acc * alpha[:, None] + tl.dot(p, v.to(tl.float32), input_precision=DOT_PRECISION)
    else:
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
    return acc, m_new, l_i


@triton.jit(do_not_specialize=["num_seqs", "stride_pm_split"])
def _paged_attention_kernel(
    q_ptr,  # [T, Hq, D]
    k_cache_ptr,  # [num_blocks, block_size, Hkv, D]
    v_cache_ptr,  # [num_blocks, block_size, Hkv, D]
    block_tables_ptr,  # int32 [B, max_blocks]
    seq_lens_ptr,  # int32 [B]
    cu_q_lens_ptr,  # int32 [B+1]
    tree_mask_ptr,  # uint8 packed masks: [q_len^2] or [] per sequence (unused unless TREE)
    tree_mask_indptr_ptr,  # int32 [B+1] (unused unless TREE)
    out_ptr,  # [T, Hq, D] (unused if SPLIT)
    part_acc_ptr,  # fp32 [num_splits, T, Hq, D] unnormalised outputs (used iff SPLIT)
    part_m_ptr,  # fp32 [num_splits, T, Hq] running max, log2 domain (used iff SPLIT)
    part_l_ptr,  # fp32 [num_splits, T, Hq] softmax denominators (used iff SPLIT)
    scale_log2,  # fp32: softmax scale * log2(e)
    num_seqs,
    stride_q_tok, stride_q_head,
    stride_k_blk, stride_k_tok, stride_k_head,
    stride_v_blk, stride_v_tok, stride_v_head,
    stride_bt_seq,
    stride_o_tok, stride_o_head,
    stride_pa_split, stride_pa_tok, stride_pa_head,
    stride_pm_split, stride_pm_tok,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,  # power of 2, >= 16
    BLOCK_SIZE: tl.constexpr,  # KV cache block size (tokens per block)
    GROUP: tl.constexpr,  # query heads per KV head
    BLOCK_Q: tl.constexpr,  # new tokens per program; BLOCK_Q * GROUP <= BLOCK_M
    BLOCK_M: tl.constexpr,  # rows of the score tile: (token, query head) pairs
    BLOCK_N: tl.constexpr,  # keys per KV tile
    BLOCK_N_MASKED: tl.constexpr,  # keys per KV tile in the masked loop; divides BLOCK_N
    TREE: tl.constexpr,  # packed tree masks (a sequence with an empty slice is causal); else all causal
    SPLIT: tl.constexpr,  # write partial softmax state for the reduce kernel (else the final output)
    DOT_F32: tl.constexpr,  # upcast K/V/P to fp32 before tl.dot (the interpreter's bf16 dot is wrong)
    DOT_PRECISION: tl.constexpr,  # tl.dot input_precision: "ieee" for fp32 operands, None (default) otherwise
):  # fmt: skip
    pid_q = tl.program_id(0)  # global q tile, over all sequences (see the launcher's grid)
    kv_head = tl.program_id(1).to(tl.int64)
    split = tl.program_id(2)
    num_splits = tl.num_programs(2)

    # Sequence b owns q tiles [cu[b] // BLOCK_Q + b, cu[b+1] // BLOCK_Q + b + 1): binary search for the last b
    # whose first tile is <= pid_q. The grid has T // BLOCK_Q + B tiles, so no host sync is needed to size it.
    lo: tl.int32 = 0
    hi = num_seqs - 1
    while lo < hi:
        mid = (lo + hi + 1) // 2
        first_tile = tl.load(cu_q_lens_ptr + mid) // BLOCK_Q + mid
        lo = tl.where(first_tile <= pid_q, mid, lo)
        hi = tl.where(first_tile <= pid_q, hi, mid - 1)
    seq = lo
    q_start = tl.load(cu_q_lens_ptr + seq)
    q_len = tl.load(cu_q_lens_ptr + seq + 1) - q_start
    q_tile = pid_q - (q_start // BLOCK_Q + seq)
    if q_tile * BLOCK_Q >= q_len:  # spare tile of this sequence (or q_len == 0)
        return
    ctx_len = tl.load(seq_lens_ptr + seq)
    prefix = ctx_len - q_len  # context positions before the first new token

    # Row r of the tile is new token q_tile * BLOCK_Q + r // GROUP, query head kv_head * GROUP + r % GROUP.
    offs_m = tl.arange(0, BLOCK_M)
    q_idx = q_tile * BLOCK_Q + offs_m // GROUP  # [BLOCK_M] index among the sequence's new tokens
    head = kv_head * GROUP + offs_m % GROUP  # [BLOCK_M] query head (int64)
    # Rows that exist (and get stored). NOTE: a compare against one scalar, not per-row q_idx < q_len, so that no
    # per-row value has to stay live across the KV loop just for the final store.
    num_rows = tl.minimum(q_len - q_tile * BLOCK_Q, BLOCK_Q) * GROUP
    # NOTE: padding rows read the last new token again instead of being masked: every load below stays in
    # bounds with no row predicate, which keeps register (predicate) pressure down; they are never stored.
    q_row = tl.minimum(q_idx, q_len - 1)
    tok = (q_start + q_row).to(tl.int64)  # [BLOCK_M] row of q / out
    offs_d = tl.arange(0, HEAD_DIM_PAD)
    # NOTE: an all-true constant when D is a power of 2, so `& d_ok` folds away.
    d_ok = offs_d < HEAD_DIM if HEAD_DIM < HEAD_DIM_PAD else tl.full([HEAD_DIM_PAD], 1, tl.int1)
    q_ptrs = q_ptr + tok[:, None] * stride_q_tok + head[:, None] * stride_q_head + offs_d[None, :]
    q = tl.load(q_ptrs, mask=d_ok[None, :], other=0.0)  # [BLOCK_M, HEAD_DIM_PAD]
    if DOT_F32:
        q = q.to(tl.float32)

    # Keys [0, kv_end) may be visible: all the context for a tree (a mask may point anywhere), else up to the
    # tile's last new token. Keys [0, unmasked_end) are visible to every row of the tile: the context prefix
    # for a tree, and up to the tile's first new token when causal.
    kv_end = prefix + tl.minimum((q_tile + 1) * BLOCK_Q, q_len)
    unmasked_end = prefix + q_tile * BLOCK_Q + 1
    if TREE:
        mask_start = tl.load(tree_mask_indptr_ptr + seq)
        mask_len = tl.load(tree_mask_indptr_ptr + seq + 1) - mask_start
        has_tree = mask_len > 0  # an empty slice: causal
        width = mask_len // q_len  # the mask covers the last `width` keys (>= q_len: earlier tree nodes too)
        tree_start = ctx_len - width
        kv_end = tl.where(has_tree, ctx_len, kv_end)
        unmasked_end = tl.where(has_tree, tree_start, unmasked_end)
        mask_seq_ptr = tree_mask_ptr + mask_start.to(tl.int64)
        mask_rows = q_row * width  # [BLOCK_M] int32 offsets of each row's mask in mask_seq_ptr
    else:
        has_tree = False  # unused
        tree_start = prefix  # unused
        mask_seq_ptr = tree_mask_ptr  # unused
        mask_rows = q_idx  # unused
    num_tiles = tl.cdiv(kv_end, BLOCK_N)
    num_unmasked_tiles = unmasked_end // BLOCK_N
    # This split's share of the tiles (all of them when there is one split).
    tiles_per_split = tl.cdiv(num_tiles, num_splits)
    tile_lo = split * tiles_per_split
    tile_hi = tl.minimum(tile_lo + tiles_per_split, num_tiles)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)  # running max of scaled scores (log2 domain)
    l_i = tl.zeros([BLOCK_M], tl.float32)  # running softmax denominator
    acc = tl.zeros([BLOCK_M, HEAD_DIM_PAD], tl.float32)  # running unnormalised output
    bt_row = block_tables_ptr + seq.to(tl.int64) * stride_bt_seq
    k_head_ptr = k_cache_ptr + kv_head * stride_k_head
    v_head_ptr = v_cache_ptr + kv_head * stride_v_head
    # NOTE: two loops. The long, fully visible part of the context runs without mask work; the rest (usually
    # one BLOCK_N tile) runs in smaller BLOCK_N_MASKED tiles, which keeps the mask's registers down and skips
    # the keys past kv_end.
    for t in range(tile_lo, tl.minimum(tile_hi, num_unmasked_tiles)):
        acc, m_i, l_i = _attend_tile(
            acc, m_i, l_i, q, t, kv_end, prefix, q_idx, has_tree, tree_start, mask_seq_ptr, mask_rows,
            bt_row, k_head_ptr, v_head_ptr, stride_k_blk, stride_k_tok, stride_v_blk, stride_v_tok,
            offs_d, d_ok, scale_log2, BLOCK_SIZE, BLOCK_N, TREE, False, DOT_F32, DOT_PRECISION,
        )  # fmt: skip
    SUB: tl.constexpr = BLOCK_N // BLOCK_N_MASKED
    masked_hi = tl.minimum(tile_hi * SUB, tl.cdiv(kv_end, BLOCK_N_MASKED))
    for t in range(tl.maximum(tile_lo, num_unmasked_tiles) * SUB, masked_hi):
        acc, m_i, l_i = _attend_tile(
            acc, m_i, l_i, q, t, kv_end, prefix, q_idx, has_tree, tree_start, mask_seq_ptr, mask_rows,
            bt_row, k_head_ptr, v_head_ptr, stride_k_blk, stride_k_tok, stride_v_blk, stride_v_tok,
            offs_d, d_ok, scale_log2, BLOCK_SIZE, BLOCK_N_MASKED, TREE, True, DOT_F32, DOT_PRECISION,
        )  # fmt: skip

    row_ok = offs_m < num_rows
    out_mask = row_ok[:, None] & d_ok[None, :]
    if SPLIT:
        split64 = split.to(tl.int64)
        pa = split64 * stride_pa_split + tok[:, None] * stride_pa_tok + head[:, None] * stride_pa_head
        tl.store(part_acc_ptr + pa + offs_d[None, :], acc, mask=out_mask)
        pm = split64 * stride_pm_split + tok * stride_pm_tok + head
        tl.store(part_m_ptr + pm, m_i, mask=row_ok)
        tl.store(part_l_ptr + pm, l_i, mask=row_ok)
    else:
        # NOTE: a row with no visible key (only a tree mask without its diagonal can do that) gives 0, not NaN.
        inv_l = 1.0 / tl.where(l_i == 0.0, 1.0, l_i)  # BLOCK_M divisions, then BLOCK_M x D multiplies
        out = acc * inv_l[:, None]
        o_off = tok[:, None] * stride_o_tok + head[:, None] * stride_o_head + offs_d[None, :]
        tl.store(out_ptr + o_off, out.to(out_ptr.dtype.element_ty), mask=out_mask)


@triton.jit(do_not_specialize=["num_splits", "stride_pm_split"])
def _paged_attention_reduce_kernel(
    part_acc_ptr,  # fp32 [num_splits, T, Hq, D]
    part_m_ptr,  # fp32 [num_splits, T, Hq]
    part_l_ptr,  # fp32 [num_splits, T, Hq]
    out_ptr,  # [T, Hq, D]
    num_splits,
    stride_pa_split, stride_pa_tok, stride_pa_head,
    stride_pm_split, stride_pm_tok,
    stride_o_tok, stride_o_head,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    SPLITS_PAD: tl.constexpr,  # power of 2 >= num_splits
):
    tok = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1).to(tl.int64)
    offs_s = tl.arange(0, SPLITS_PAD)
    s_ok = offs_s < num_splits
    offs_d = tl.arange(0, HEAD_DIM_PAD)
    # NOTE: an all-true constant when D is a power of 2, so `& d_ok` folds away (fewer predicate registers).
    d_ok = offs_d < HEAD_DIM if HEAD_DIM < HEAD_DIM_PAD else tl.full([HEAD_DIM_PAD], 1, tl.int1)
    pm = offs_s.to(tl.int64) * stride_pm_split + tok * stride_pm_tok + head  # [SPLITS_PAD]
    m = tl.load(part_m_ptr + pm, mask=s_ok, other=float("-inf"))
    l_s = tl.load(part_l_ptr + pm, mask=s_ok, other=0.0)
    m_max = tl.max(m, 0)
    w = tl.exp2(m - tl.where(m_max == float("-inf"), 0.0, m_max))  # [SPLITS_PAD]; 0 for empty splits
    pa = offs_s.to(tl.int64)[:, None] * stride_pa_split + tok * stride_pa_tok + head * stride_pa_head
    acc = tl.load(part_acc_ptr + pa + offs_d[None, :], mask=s_ok[:, None] & d_ok[None, :], other=0.0)
    num = tl.sum(acc * w[:, None], 0)  # [HEAD_DIM_PAD]
    den = tl.sum(l_s * w, 0)
    out = num / tl.where(den == 0.0, 1.0, den)
    tl.store(out_ptr + tok * stride_o_tok + head * stride_o_head + offs_d, out.to(out_ptr.dtype.element_ty), mask=d_ok)


# ----------------------------------------------------------------------------------------------- launcher

_LOG2E = 1.4426950408889634
_MAX_BLOCK_M = 64  # rows (token, query head) per program
_MASKED_BLOCK_N = 16  # keys per tile in the masked loop (the last tiles), where the mask costs registers
# A split shorter than this costs more in its fixed work (q load, partial-state store, the reduce's read) than it
# wins in parallelism: 32 keys of K and V are 4x to 8x the bytes of the GROUP partial rows it writes (D >= 64).
_MIN_KEYS_PER_SPLIT = 32
_MAX_SPLITS = 64  # the reduce kernel holds SPLITS_PAD x HEAD_DIM_PAD fp32 partial outputs in registers
_DEFAULT_NUM_SMS = 132  # H100 SXM; only sizes splits where no CUDA device is there to ask (interpreter, meta)
# Triton decides at decoration time whether a jit function is compiled or interpreted (TRITON_INTERPRET).
_INTERPRETED = not isinstance(_paged_attention_kernel, triton.runtime.JITFunction)


class AttentionConfig(NamedTuple):
    constexprs: dict  # BLOCK_M, BLOCK_Q, BLOCK_N, BLOCK_N_MASKED
    num_warps: int
    num_stages: int


class LaunchPlan(NamedTuple):
    """Everything one call launches; :func:`paged_attention` runs it and the GPU compile test compiles it."""

    grid: tuple[int, int, int]
    args: dict  # every non-constexpr argument of _paged_attention_kernel, by name
    constexprs: dict  # every constexpr argument of _paged_attention_kernel
    num_warps: int
    num_stages: int
    reduce_grid: tuple[int, int] | None  # None when there is one KV split
    reduce_args: dict | None
    reduce_constexprs: dict | None
    out: torch.Tensor


def attention_configs(head_dim: int, group: int, q_len: int, dtype: torch.dtype) -> list[AttentionConfig]:
    """Tile configurations of the attention kernel for a shape class, best first; the launcher runs the first.

    Args:
        head_dim: D. group: query heads per KV head (Hq // Hkv). q_len: new tokens per sequence (1 = decode;
            the launcher passes ceil(T / B), known without a host sync). dtype: q / KV cache dtype.

    NOTE: no autotuning: it cannot run without a GPU (nor in the interpreter), and one deterministic choice
    keeps the interpreter tests, the GPU compile test and a GPU run on the same configuration. The sizes come
    from compiling for sm_80/sm_90 (tests/kernels/test_gpu_compile_attention.py prints the table): they keep
    every shape of the Llama-3.2 / Qwen2.5 family free of spills inside loops (a few configurations park one
    scalar in local memory across the loop on sm_80) and under 99 KiB of shared memory.
    """
    head_dim_pad = max(16, triton.next_power_of_2(head_dim))
    # Rows hold q_len tokens x group heads: at least 16 (tl.dot's minimum M) and at least one whole group.
    rows = triton.next_power_of_2(group * max(q_len, 1))
    block_m = max(16, triton.next_power_of_2(group), min(rows, _MAX_BLOCK_M))
    # Registers hold the fp32 accumulator (BLOCK_M x D) and the score tile (BLOCK_M x BLOCK_N); K and V tiles
    # (BLOCK_N x D each) are staged through shared memory.
    block_n = 64 if block_m * head_dim_pad <= 2048 else 32
    num_warps = 8 if block_m * head_dim_pad >= 8192 else 4
    if dtype == torch.float32:
        block_n //= 2
        # NOTE: fp32 dots are IEEE (no tensor cores: FMA-based, operands in registers). With 4 warps ptxas spills
        # hundreds of bytes inside the KV loop on sm_90 at D = 128 (255 registers); 8 warps halve each thread's
        # share of the tiles and compile without spills on sm_80 and sm_90 (61-68 registers for decode at D = 128).
        if block_m * head_dim_pad >= 2048:
            num_warps = 8
    constexprs = {"BLOCK_M": block_m, "BLOCK_Q": block_m // group, "BLOCK_N": block_n,
                  "BLOCK_N_MASKED": min(block_n, _MASKED_BLOCK_N)}  # fmt: skip
    return [AttentionConfig(constexprs, num_warps=num_warps, num_stages=2)]


@functools.cache
def _num_sms(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def num_kv_splits(
    num_programs: int,
    max_kv_len: int,
    device: torch.device,
    *,
    min_keys: int = _MIN_KEYS_PER_SPLIT,
    num_sms: int | None = None,
) -> int:
    """KV splits per program: the fewest with ``num_programs * splits >= num_sms`` (so one to two waves of CTAs
    fill every SM), as long as each split keeps ``>= min_keys`` keys; at most ``_MAX_SPLITS``; 1 when the
    programs alone fill the GPU.

    ``num_programs``: (q tile, KV head) programs that have work. ``max_kv_len`` is the block table's capacity
    (width x block size), a bound known without a host sync; the splits past a shorter sequence's end exit at
    once. ``num_sms``: default the device's SM count (``_DEFAULT_NUM_SMS`` off CUDA).
    """
    if num_sms is None:
        if device.type == "cuda":
            num_sms = _num_sms(device.index if device.index is not None else torch.cuda.current_device())
        else:
            num_sms = _DEFAULT_NUM_SMS
    if num_programs == 0 or num_programs >= num_sms:
        return 1
    by_occupancy = triton.cdiv(num_sms, num_programs)
    by_length = max_kv_len // min_keys  # floor: every split (but the ragged last one) covers >= min_keys keys
    return max(1, min(by_occupancy, by_length, _MAX_SPLITS))


def split_block_n(block_n: int, max_kv_len: int, num_splits: int) -> int:
    """BLOCK_N for a split launch: at most the largest power of two <= keys per split (so that a split is not
    one partly empty tile) and not below ``_MIN_KEYS_PER_SPLIT`` (32) nor above the configuration's own."""
    if num_splits == 1:
        return block_n
    keys = max(1, max_kv_len // num_splits)
    return min(block_n, max(_MIN_KEYS_PER_SPLIT, 1 << (keys.bit_length() - 1)))


def launch_plan(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    cu_q_lens: torch.Tensor,
    scale: float,
    tree_mask: torch.Tensor | None = None,
    tree_mask_indptr: torch.Tensor | None = None,
    *,
    num_splits: int | None = None,
    interpret: bool | None = None,
    invariant: bool = False,
) -> LaunchPlan:
    """Validate the inputs, allocate the output (and split workspace) and choose grid and configuration.

    Works on ``meta`` tensors too (no launch happens here): that is how the GPU compile test gets the exact
    arguments and constexprs a real call compiles with. ``interpret``: plan for the Triton interpreter
    (default: whether this process runs Triton interpreted); the compile test passes False.
    """
    _check_args(q, k_cache, v_cache, block_tables, seq_lens, cu_q_lens, scale, tree_mask, tree_mask_indptr)
    num_tokens, num_q_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    num_seqs = seq_lens.shape[0]
    group = num_q_heads // num_kv_heads
    device = q.device
    out = torch.empty((num_tokens, num_q_heads, head_dim), dtype=q.dtype, device=device)

    q_len_estimate = triton.cdiv(num_tokens, max(num_seqs, 1))
    if invariant:
        # Batch-invariant (issue 33): one tile configuration whatever the batch (the decode one, so the score tile's
        # layout and each row's reduction order never change) and no KV split (a split's share of the keys, and the
        # merge, would depend on the batch's widest table): a row's arithmetic depends on its own keys only.
        if num_splits not in (None, 1):
            raise ValueError(f"an invariant launch has no KV split, got num_splits={num_splits}")
        q_len_estimate, num_splits = 1, 1
    cfg = attention_configs(head_dim, group, q_len_estimate, q.dtype)[0]
    block_q = cfg.constexprs["BLOCK_Q"]
    # Sequence b gets cu[b+1] // BLOCK_Q - cu[b] // BLOCK_Q + 1 >= cdiv(q_len, BLOCK_Q) tiles (spares exit).
    num_q_tiles = num_tokens // block_q + num_seqs
    max_kv_len = block_tables.shape[1] * block_size
    if num_splits is None:
        # Programs with work when every sequence has the same q_len (the grid's spare tiles exit at once).
        busy_tiles = num_seqs * triton.cdiv(q_len_estimate, block_q)
        num_splits = num_kv_splits(busy_tiles * num_kv_heads, max_kv_len, device)
    if not 1 <= num_splits <= 1024:
        raise ValueError(f"num_splits must be in [1, 1024], got {num_splits}")
    tile_constexprs = dict(cfg.constexprs)
    tile_constexprs["BLOCK_N"] = split_block_n(cfg.constexprs["BLOCK_N"], max_kv_len, num_splits)
    split = num_splits > 1
    tree = tree_mask is not None
    if split:
        part_acc = torch.empty((num_splits, num_tokens, num_q_heads, head_dim), dtype=torch.float32, device=device)
        part_m = torch.empty((num_splits, num_tokens, num_q_heads), dtype=torch.float32, device=device)
        part_l = torch.empty_like(part_m)
    else:
        part_acc = part_m = part_l = out  # unused
    args = {
        "q_ptr": q, "k_cache_ptr": k_cache, "v_cache_ptr": v_cache, "block_tables_ptr": block_tables,
        "seq_lens_ptr": seq_lens, "cu_q_lens_ptr": cu_q_lens,
        # NOTE: a bool tensor would reach Triton as an int1 pointer; read the mask as bytes (same storage).
        "tree_mask_ptr": tree_mask.view(torch.uint8) if tree else seq_lens,  # dummies when causal
        "tree_mask_indptr_ptr": tree_mask_indptr if tree else seq_lens,
        "out_ptr": out, "part_acc_ptr": part_acc, "part_m_ptr": part_m, "part_l_ptr": part_l,
        "scale_log2": float(scale) * _LOG2E, "num_seqs": num_seqs,
        "stride_q_tok": q.stride(0), "stride_q_head": q.stride(1),
        "stride_k_blk": k_cache.stride(0), "stride_k_tok": k_cache.stride(1), "stride_k_head": k_cache.stride(2),
        "stride_v_blk": v_cache.stride(0), "stride_v_tok": v_cache.stride(1), "stride_v_head": v_cache.stride(2),
        "stride_bt_seq": block_tables.stride(0),
        "stride_o_tok": out.stride(0), "stride_o_head": out.stride(1),
        "stride_pa_split": part_acc.stride(0) if split else 0,
        "stride_pa_tok": part_acc.stride(1) if split else 0,
        "stride_pa_head": part_acc.stride(2) if split else 0,
        "stride_pm_split": part_m.stride(0) if split else 0,
        "stride_pm_tok": part_m.stride(1) if split else 0,
    }  # fmt: skip
    head_dim_pad = max(16, triton.next_power_of_2(head_dim))
    dot_f32 = (_INTERPRETED if interpret is None else interpret) and q.dtype == torch.bfloat16
    constexprs = {
        "HEAD_DIM": head_dim, "HEAD_DIM_PAD": head_dim_pad, "BLOCK_SIZE": block_size, "GROUP": group,
        **tile_constexprs, "TREE": tree, "SPLIT": split,
        # bf16 tl.dot is wrong in the interpreter (TRITON_ON_CPU.md); fp16/fp32 dots are exact there.
        "DOT_F32": dot_f32,
        # fp32 means fp32: tl.dot's default input precision on a GPU is tf32 (10-bit mantissa operands).
        "DOT_PRECISION": "ieee" if q.dtype == torch.float32 or dot_f32 else None,
    }  # fmt: skip
    reduce_grid = reduce_args = reduce_constexprs = None
    if split:
        reduce_grid = (num_tokens, num_q_heads)
        reduce_args = {
            "part_acc_ptr": part_acc, "part_m_ptr": part_m, "part_l_ptr": part_l, "out_ptr": out,
            "num_splits": num_splits,
            "stride_pa_split": part_acc.stride(0), "stride_pa_tok": part_acc.stride(1),
            "stride_pa_head": part_acc.stride(2),
            "stride_pm_split": part_m.stride(0), "stride_pm_tok": part_m.stride(1),
            "stride_o_tok": out.stride(0), "stride_o_head": out.stride(1),
        }  # fmt: skip
        reduce_constexprs = {"HEAD_DIM": head_dim, "HEAD_DIM_PAD": head_dim_pad,
                             "SPLITS_PAD": triton.next_power_of_2(num_splits)}  # fmt: skip
    return LaunchPlan(
        grid=(num_q_tiles, num_kv_heads, num_splits), args=args, constexprs=constexprs,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
        reduce_grid=reduce_grid, reduce_args=reduce_args, reduce_constexprs=reduce_constexprs, out=out,
    )  # fmt: skip


def paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    cu_q_lens: torch.Tensor,
    scale: float,
    tree_mask: torch.Tensor | None = None,
    tree_mask_indptr: torch.Tensor | None = None,
    *,
    num_splits: int | None = None,
    invariant: bool = False,
) -> torch.Tensor:
    """Triton paged attention; same semantics as :func:`paged_attention_reference`.

    Args:
        q: ``[T, Hq, D]`` fp32/fp16/bf16, last dim contiguous; rows ``cu_q_lens[b]:cu_q_lens[b+1]`` are
            sequence b's last ``q_len`` context positions.
        k_cache, v_cache: ``[num_blocks, block_size, Hkv, D]`` in q's dtype, last dim contiguous, any other
            strides; ``Hq % Hkv == 0``; ``1 <= D <= 256``.
        block_tables: int32 ``[B, max_blocks]``, rows contiguous; physical block ids in logical order.
        seq_lens: int32 ``[B]`` context length per sequence, new tokens included (``q_len <= seq_len``).
        cu_q_lens: int32 ``[B+1]`` cumulative new-token counts, ``cu_q_lens[B] == T``; ``q_len == 0`` allowed.
        scale: softmax scale, usually ``D ** -0.5``.
        tree_mask: optional bool/uint8, contiguous 1-d: packed row-major ``[q_len, w]`` masks over each sequence's
            last ``w >= q_len`` keys (the new tokens are the last q_len of them): new token i sees key
            ``seq_len - w + j`` iff ``mask[i, j]``, and always the context before those w keys. Default: causal.
        tree_mask_indptr: int32 ``[B+1]`` offsets of each sequence's mask in ``tree_mask`` (with ``tree_mask``).
            Sequence b's slice ``tree_mask[indptr[b]:indptr[b+1]]`` is either empty - b is causal, as without a
            mask (a prefill chunk or chain in a tree batch costs no mask bytes) - or ``q_len_b * w_b`` entries,
            ``q_len_b <= w_b <= seq_len_b`` (``w_b = q_len_b``: a square mask over the new tokens; larger: a draft
            model's tree level also masking the tree nodes cached by earlier levels).
        num_splits: KV splits per (q tile, KV head) program, merged by a second kernel (flash-decoding);
            default from :func:`num_kv_splits`. A tuning/testing knob, not part of the attention contract.
        invariant: one launch configuration for every batch and no KV split, so a row's output does not depend
            on the other rows (``LLM(batch_invariant=True)``; slower where splits would have filled the GPU).
    Returns:
        ``[T, Hq, D]`` in q's dtype, from fp32 accumulation and an online softmax. A row that sees no key at all
        (a tree mask row without its diagonal and an empty prefix) is 0 here, NaN in the reference.

    No host sync on CUDA (the grid comes from shapes). On CPU (the interpreter) the index values are checked
    too, because an out-of-range block id would crash the interpreter instead of raising.
    """
    plan = launch_plan(q, k_cache, v_cache, block_tables, seq_lens, cu_q_lens, scale, tree_mask, tree_mask_indptr,
                       num_splits=num_splits, invariant=invariant)  # fmt: skip
    if q.shape[0] == 0:
        return plan.out
    _paged_attention_kernel[plan.grid](
        **plan.args, **plan.constexprs, num_warps=plan.num_warps, num_stages=plan.num_stages
    )
    if plan.reduce_grid is not None:
        _paged_attention_reduce_kernel[plan.reduce_grid](**plan.reduce_args, **plan.reduce_constexprs, num_warps=4)
    return plan.out


def paged_attention_uniform(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    cu_q_lens: torch.Tensor,
    q_len: int,
    scale: float,
    *,
    num_splits: int | None = None,
    invariant: bool = False,
) -> torch.Tensor:
    """Triton paged attention for a uniform causal batch (every sequence has ``q_len`` new tokens), capturable in
    a CUDA graph: same semantics as :func:`paged_attention` with ``cu_q_lens = [0, q_len, 2 q_len, ...]``.

    Nothing here reads a device value on CUDA: the grid (``T // BLOCK_Q + B`` q tiles, Hkv, splits), the tile
    configuration (from ``q_len``, a Python int) and the KV split plan (from ``max_blocks * block_size``, the block
    table's capacity) come from shapes and Python ints only, so a replay with other ``seq_lens`` / block tables
    of the same shapes is the same launch. ``cu_q_lens`` is still passed (the kernel reads it on the device): the
    static forward keeps it in a persistent buffer.

    Args: as :func:`paged_attention`; q ``[B * q_len, Hq, D]``, ``q_len >= 1`` a Python int.
    """
    num_seqs = block_tables.shape[0]
    if not isinstance(q_len, int) or isinstance(q_len, bool) or q_len < 1:
        raise ValueError(f"q_len must be a Python int >= 1 (part of the static shape), got {q_len!r}")
    if q.shape[0] != num_seqs * q_len:
        raise ValueError(f"a uniform batch of {num_seqs} sequences x q_len {q_len} needs {num_seqs * q_len} q rows, "
                         f"got {q.shape[0]}")
    return paged_attention(q, k_cache, v_cache, block_tables, seq_lens, cu_q_lens, scale, num_splits=num_splits,
                           invariant=invariant)


def _check_args(q, k_cache, v_cache, block_tables, seq_lens, cu_q_lens, scale, tree_mask, tree_mask_indptr):
    """Raise ValueError on anything the kernel would silently misread (it never validates)."""
    named = {"q": q, "k_cache": k_cache, "v_cache": v_cache, "block_tables": block_tables,
             "seq_lens": seq_lens, "cu_q_lens": cu_q_lens}  # fmt: skip
    if (tree_mask is None) != (tree_mask_indptr is None):
        raise ValueError("tree_mask and tree_mask_indptr must be given together")
    if tree_mask is not None:
        named |= {"tree_mask": tree_mask, "tree_mask_indptr": tree_mask_indptr}
    for name, t in named.items():
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.device != q.device:
            raise ValueError(f"{name} is on {t.device} but q is on {q.device}")
    if q.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        raise ValueError(f"q must be fp32/fp16/bf16, got {q.dtype}")
    if k_cache.dtype != q.dtype or v_cache.dtype != q.dtype:
        raise ValueError(f"k_cache/v_cache dtypes ({k_cache.dtype}, {v_cache.dtype}) must equal q's ({q.dtype})")
    if q.ndim != 3 or k_cache.ndim != 4:
        raise ValueError(f"q must be [T, Hq, D] and k_cache [num_blocks, block_size, Hkv, D]; got ndim "
                         f"{q.ndim} and {k_cache.ndim}")  # fmt: skip
    if v_cache.shape != k_cache.shape:
        raise ValueError(f"v_cache shape {tuple(v_cache.shape)} != k_cache shape {tuple(k_cache.shape)}")
    num_q_heads, head_dim = q.shape[1], q.shape[2]
    num_kv_heads = k_cache.shape[2]
    if k_cache.shape[3] != head_dim or head_dim == 0 or head_dim > 256:
        raise ValueError(f"head_dim of q ({head_dim}) and cache ({k_cache.shape[3]}) must match, in [1, 256]")
    if num_kv_heads == 0 or num_q_heads % num_kv_heads != 0:
        raise ValueError(f"Hq ({num_q_heads}) must be a positive multiple of Hkv ({num_kv_heads})")
    if k_cache.shape[1] == 0:
        raise ValueError("block_size must be >= 1")
    for name in ("q", "k_cache", "v_cache"):
        if named[name].stride(-1) != 1:
            raise ValueError(f"{name} must be contiguous in its last (head_dim) dimension")
    num_seqs = seq_lens.shape[0] if seq_lens.ndim == 1 else -1
    index_shapes = {"block_tables": (2, None), "seq_lens": (1, None), "cu_q_lens": (1, num_seqs + 1)}
    if tree_mask is not None:
        index_shapes["tree_mask_indptr"] = (1, num_seqs + 1)
    for name, (ndim, length) in index_shapes.items():
        t = named[name]
        if t.dtype != torch.int32:
            raise ValueError(f"{name} must be int32, got {t.dtype}")
        if t.ndim != ndim or t.stride(-1) != 1:
            raise ValueError(f"{name} must be a {ndim}-d tensor contiguous in its last dimension")
        if length is not None and t.shape[0] != length:
            raise ValueError(f"{name} must have B + 1 = {length} entries, got {t.shape[0]}")
    if block_tables.shape[0] != num_seqs:
        raise ValueError(f"block_tables has {block_tables.shape[0]} rows but seq_lens {num_seqs} entries")
    if num_seqs == 0 and q.shape[0] != 0:
        raise ValueError(f"q has {q.shape[0]} rows but the batch has no sequence")
    if tree_mask is not None and (tree_mask.dtype not in (torch.bool, torch.uint8) or tree_mask.ndim != 1
                                  or not tree_mask.is_contiguous()):  # fmt: skip
        raise ValueError(f"tree_mask must be a contiguous 1-d bool/uint8 tensor, got {tree_mask.dtype}")
    if not math.isfinite(scale):
        raise ValueError(f"scale must be finite, got {scale}")
    if q.device.type == "cpu":
        _check_values(q, k_cache, block_tables, seq_lens, cu_q_lens, tree_mask, tree_mask_indptr)


def _check_values(q, k_cache, block_tables, seq_lens, cu_q_lens, tree_mask, tree_mask_indptr):
    """Index checks that need the values: free on CPU, a host sync on CUDA (so only done on CPU)."""
    num_blocks, block_size = k_cache.shape[:2]
    q_lens = cu_q_lens[1:] - cu_q_lens[:-1]
    if int(cu_q_lens[0]) != 0 or bool((q_lens < 0).any()) or int(cu_q_lens[-1]) != q.shape[0]:
        raise ValueError(f"cu_q_lens must rise from 0 to T = {q.shape[0]}, got {cu_q_lens.tolist()}")
    if bool((seq_lens < q_lens).any()) or bool((seq_lens > block_tables.shape[1] * block_size).any()):
        raise ValueError("need q_len <= seq_len <= max_blocks * block_size for every sequence")
    used = torch.arange(block_tables.shape[1]) < ((seq_lens + block_size - 1) // block_size)[:, None]
    ids = block_tables[used]
    if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= num_blocks):
        raise ValueError(f"block_tables holds ids outside [0, {num_blocks}) in the blocks that seq_lens uses")
    if tree_mask is not None:
        sizes = (tree_mask_indptr[1:] - tree_mask_indptr[:-1]).long()  # [B]
        ql = q_lens.long()
        width = sizes // ql.clamp(min=1)  # keys each mask covers
        ok = (sizes == 0) | ((ql > 0) & (sizes == ql * width) & (width >= ql) & (width <= seq_lens.long()))
        bad = (~ok).nonzero().flatten().tolist()
        if bad:
            b = bad[0]
            raise ValueError(f"sequence {b}'s tree mask slice (tree_mask_indptr[{b}:{b + 2}]) has {int(sizes[b])} "
                             f"entries; it must be empty (causal) or q_len * w with q_len = {int(ql[b])} <= w <= "
                             f"seq_len = {int(seq_lens[b])} (a [q_len, w] mask over the last w keys)")
        if int(tree_mask_indptr[0]) < 0 or int(tree_mask_indptr[-1]) > tree_mask.numel():
            raise ValueError(f"tree_mask_indptr must rise from >= 0 to <= tree_mask's {tree_mask.numel()} entries: "
                             f"every mask slice must lie within tree_mask")
