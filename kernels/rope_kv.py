"""Rotary embeddings fused with the write of the new K/V into the paged cache.

The unfused attention prologue - split the qkv projection, gather cos/sin rows by position, rotate q and k (a
``rotate_half`` cat, four multiplies, two adds, casts), then index-put k and v into their cache slots - is about
fifteen small kernels per layer on a GPU. Here one program per (token, head) reads that head's slice of the qkv
projection once: a query head is rotated and written to ``q [T, Hq, D]``; a KV head is rotated (k) and written with
its v straight into the slot ``slot_mapping[t]`` of the paged cache.

Rounding follows the torch reference (``rope_write_kv_reference``, the CPU path and the oracle): cos/sin rounded to
the model dtype, each product rounded, the sum rounded. A product of two bf16/fp16 values is exact in fp32, so the
kernel gives the reference's values bit for bit in every dtype, provided the compiler does not contract a product
and the sum into one FMA across the casts: on an H200 it did (one ulp in ~17% of bf16/fp16 elements,
bench/results/gpu_h200_20261128_tests/), so the kernel is compiled with ``COMPILE_OPTIONS`` (no FP fusion;
``tests/kernels/test_gpu_compile_fused_forward.py`` checks its PTX has no ``fma``).

Also here: :func:`write_kv`, the cache write the reference uses, with its ``torch.compile``-opaque custom op.
"""

from __future__ import annotations

import torch

from specdec.kernels._triton import tl, triton

# NOTE: the GPU compile would otherwise fuse x1 * cos with the following add into an FMA, skipping the product's
# rounding to the model dtype that the reference (HF's rope in that dtype) does
COMPILE_OPTIONS = {"enable_fp_fusion": False}


@triton.jit
def _rope_write_kv_kernel(
    qkv_ptr,  # [T, (Hq + 2 Hkv) * D] model dtype, unit column stride: q heads, then k heads, then v heads
    positions_ptr,  # int64 [T]
    cos_ptr,  # fp32 [P, D] contiguous
    sin_ptr,  # fp32 [P, D] contiguous
    slot_mapping_ptr,  # int64 [T] flat cache slot of each token (negative: not written)
    k_cache_ptr,  # [num_blocks * block_size, Hkv, D] contiguous, cache dtype
    v_cache_ptr,  # [num_blocks * block_size, Hkv, D] contiguous, cache dtype
    q_out_ptr,  # [T, Hq, D] model dtype, contiguous
    qkv_row_stride,
    num_heads,
    num_kv_heads,
    HEAD_DIM: tl.constexpr,
    BLOCK_HALF: tl.constexpr,  # next power of two >= HEAD_DIM // 2
):
    token = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    half: tl.constexpr = HEAD_DIM // 2
    d = tl.arange(0, BLOCK_HALF)
    dmask = d < half
    dtype = q_out_ptr.dtype.element_ty

    pos = tl.load(positions_ptr + token)
    table = pos * HEAD_DIM
    # NOTE: rounded to the model dtype as the reference's ``cos.to(q.dtype)``, then exact in fp32
    cos1 = tl.load(cos_ptr + table + d, mask=dmask, other=0.0).to(dtype).to(tl.float32)
    cos2 = tl.load(cos_ptr + table + half + d, mask=dmask, other=0.0).to(dtype).to(tl.float32)
    sin1 = tl.load(sin_ptr + table + d, mask=dmask, other=0.0).to(dtype).to(tl.float32)
    sin2 = tl.load(sin_ptr + table + half + d, mask=dmask, other=0.0).to(dtype).to(tl.float32)

    row = qkv_ptr + token * qkv_row_stride
    src = row + head * HEAD_DIM  # query head `head`, or KV head `head - num_heads` (k heads follow the q heads)
    x1 = tl.load(src + d, mask=dmask, other=0.0).to(tl.float32)
    x2 = tl.load(src + half + d, mask=dmask, other=0.0).to(tl.float32)
    # x * cos + rotate_half(x) * sin, rotate_half(x) = [-x2, x1]; every product and sum rounded as in torch
    out1 = ((x1 * cos1).to(dtype).to(tl.float32) + (-x2 * sin1).to(dtype).to(tl.float32)).to(dtype)
    out2 = ((x2 * cos2).to(dtype).to(tl.float32) + (x1 * sin2).to(dtype).to(tl.float32)).to(dtype)
    if head < num_heads:
        dst = q_out_ptr + (token * num_heads + head) * HEAD_DIM
        tl.store(dst + d, out1, mask=dmask)
        tl.store(dst + half + d, out2, mask=dmask)
    else:
        kv_head = head - num_heads
        slot = tl.load(slot_mapping_ptr + token)
        if slot >= 0:
            cache_dtype = k_cache_ptr.dtype.element_ty
            offset = (slot * num_kv_heads + kv_head) * HEAD_DIM
            tl.store(k_cache_ptr + offset + d, out1.to(cache_dtype), mask=dmask)
            tl.store(k_cache_ptr + offset + half + d, out2.to(cache_dtype), mask=dmask)
            v_src = row + (num_heads + num_kv_heads + kv_head) * HEAD_DIM
            v1 = tl.load(v_src + d, mask=dmask, other=0.0)
            v2 = tl.load(v_src + half + d, mask=dmask, other=0.0)
            tl.store(v_cache_ptr + offset + d, v1.to(cache_dtype), mask=dmask)
            tl.store(v_cache_ptr + offset + half + d, v2.to(cache_dtype), mask=dmask)


def _check(qkv, positions, cos, sin, k_cache, v_cache, slot_mapping, num_heads, num_kv_heads) -> None:
    if qkv.ndim != 2 or qkv.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        raise ValueError(f"qkv must be fp32/fp16/bf16 [T, (Hq + 2 Hkv) * D], got {qkv.dtype} {tuple(qkv.shape)}")
    if k_cache.ndim != 4 or k_cache.shape != v_cache.shape or k_cache.dtype != v_cache.dtype:
        raise ValueError(f"k_cache / v_cache must be one shape [num_blocks, block_size, Hkv, D] and dtype, got "
                         f"{tuple(k_cache.shape)} {k_cache.dtype} / {tuple(v_cache.shape)} {v_cache.dtype}")
    head_dim = k_cache.shape[-1]
    if head_dim % 2 or k_cache.shape[2] != num_kv_heads:
        raise ValueError(f"cache heads {tuple(k_cache.shape[2:])} do not match num_kv_heads={num_kv_heads} with an "
                         "even head_dim")
    if qkv.shape[1] != (num_heads + 2 * num_kv_heads) * head_dim:
        raise ValueError(f"qkv has {qkv.shape[1]} columns, expected (num_heads {num_heads} + 2 * num_kv_heads "
                         f"{num_kv_heads}) * head_dim {head_dim}")
    if qkv.shape[1] > 1 and qkv.stride(1) != 1:
        raise ValueError("qkv must have unit column stride (call .contiguous())")
    if not (k_cache.is_contiguous() and v_cache.is_contiguous()):
        raise ValueError("k_cache and v_cache must be contiguous")
    tokens = qkv.shape[0]
    for name, idx in (("positions", positions), ("slot_mapping", slot_mapping)):
        if idx.shape != (tokens,) or idx.dtype != torch.int64 or (tokens > 1 and idx.stride(0) != 1):
            raise ValueError(f"{name} must be a contiguous int64 [{tokens}], got {idx.dtype} {tuple(idx.shape)}")
    for name, table in (("cos", cos), ("sin", sin)):
        if table.ndim != 2 or table.shape[1] != head_dim or table.dtype != torch.float32 or not table.is_contiguous():
            raise ValueError(f"{name} must be a contiguous fp32 [max_positions, {head_dim}] table, got {table.dtype} "
                             f"{tuple(table.shape)}")
    devices = {t.device for t in (qkv, positions, cos, sin, k_cache, v_cache, slot_mapping)}
    if len(devices) != 1:
        raise ValueError(f"rope_write_kv's tensors must be on one device, got {sorted(map(str, devices))}")


def rope_write_kv(qkv: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                  k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor, num_heads: int,
                  num_kv_heads: int) -> torch.Tensor:
    """Triton rope + paged K/V write; same contract as :func:`rope_write_kv_reference`. Positions must index rows
    of the tables and slots the cache (not checked on the host: that would read the device). A negative slot is not
    valid input: the kernel writes nothing for it (no write out of bounds), the reference's indexing would wrap."""
    _check(qkv, positions, cos, sin, k_cache, v_cache, slot_mapping, num_heads, num_kv_heads)
    tokens, head_dim = qkv.shape[0], k_cache.shape[-1]
    q = torch.empty((tokens, num_heads, head_dim), dtype=qkv.dtype, device=qkv.device)
    if tokens == 0:
        return q
    _rope_write_kv_kernel[(tokens, num_heads + num_kv_heads)](
        qkv, positions, cos, sin, slot_mapping, k_cache, v_cache, q, qkv.stride(0), num_heads, num_kv_heads,
        HEAD_DIM=head_dim, BLOCK_HALF=triton.next_power_of_2(head_dim // 2), num_warps=1 if head_dim <= 128 else 2,
        **COMPILE_OPTIONS,
    )  # fmt: skip
    return q


def apply_rope_reference(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                         positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate ``q [T, Hq, D]`` and ``k [T, Hkv, D]`` by ``positions`` (int64 ``[T]``) with the fp32 tables
    ``cos, sin [P, D]`` (HF ``rotate_half`` convention), in q's dtype."""
    cos = cos[positions][:, None, :].to(q.dtype)  # (T, 1, D)
    sin = sin[positions][:, None, :].to(q.dtype)  # (T, 1, D)
    return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat([-x[..., half:], x[..., :half]], dim=-1)


def write_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor, k: torch.Tensor,
             v: torch.Tensor) -> None:
    """Store ``k, v [T, Hkv, D]`` at the flat slots ``slot_mapping`` (int64 ``[T]``) of ``k_cache, v_cache
    [num_blocks, block_size, Hkv, D]``, in place. Under ``torch.compile`` an opaque custom op: traced as plain
    indexing, the write to a view of the pool is functionalised into a copy of the whole pool per layer (a tiny
    llama's compiled decode went from 1.1 ms to 260 ms with a 20000-block pool); the custom op is re-inplaced by
    Inductor."""
    if torch.compiler.is_dynamo_compiling():
        torch.ops.specdec.write_kv(k_cache, v_cache, slot_mapping, k, v)
    else:
        _write_kv(k_cache, v_cache, slot_mapping, k, v)


def _write_kv(k_cache, v_cache, slot_mapping, k, v) -> None:
    num_kv_heads, head_dim = k.shape[1], k.shape[2]
    k_cache.view(-1, num_kv_heads, head_dim)[slot_mapping] = k.to(k_cache.dtype)
    v_cache.view(-1, num_kv_heads, head_dim)[slot_mapping] = v.to(v_cache.dtype)


@torch.library.custom_op("specdec::write_kv", mutates_args=("k_cache", "v_cache"))
def _write_kv_op(k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor, k: torch.Tensor,
                 v: torch.Tensor) -> None:
    _write_kv(k_cache, v_cache, slot_mapping, k, v)


@_write_kv_op.register_fake
def _(k_cache, v_cache, slot_mapping, k, v) -> None:
    return None


def rope_write_kv_reference(qkv: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                            k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor,
                            num_heads: int, num_kv_heads: int) -> torch.Tensor:
    """Split ``qkv [T, (Hq + 2 Hkv) * D]`` (q heads, k heads, v heads), rotate q and k by ``positions`` (int64
    ``[T]``) with the fp32 tables ``cos, sin [P, D]``, write k and v at ``slot_mapping`` (int64 ``[T]``) into
    ``k_cache, v_cache [num_blocks, block_size, Hkv, D]`` (in place, cast to the cache's dtype) and return the
    rotated ``q [T, Hq, D]`` in qkv's dtype. The CPU path of the model's attention and the oracle of
    :func:`rope_write_kv`."""
    tokens, head_dim = qkv.shape[0], k_cache.shape[-1]
    q, k, v = qkv.split([num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim], dim=-1)
    q = q.view(tokens, num_heads, head_dim)  # (T, Hq, D)
    k = k.view(tokens, num_kv_heads, head_dim)  # (T, Hkv, D)
    v = v.view(tokens, num_kv_heads, head_dim)  # (T, Hkv, D)
    q, k = apply_rope_reference(q, k, cos, sin, positions)
    write_kv(k_cache, v_cache, slot_mapping, k, v)
    return q
