"""Row-invariant paged attention for CPUs with AVX-512 (``attention.c``, built at first use).

Same contract as ``paged_attention_reference`` (``kernels/paged_attention_reference.py``), which is its test oracle up
to float rounding. What it adds is invariance: each query row's output is computed by one fixed sequence of
operations - keys in position order, a fixed dot product, a sequential softmax sum - whatever the other rows of the
call (a decode, a verification window, a tree window, a prefill chunk, a batch of 64) and whatever the thread
count; a tree row attends its visible keys in the order its path's decodes did. The arithmetic is spelled out in
``attention.c``. torch's SDPA, the reference path, picks its blocking by the query and key lengths.
"""

from __future__ import annotations

import ctypes
import functools
from pathlib import Path

import torch

from specdec.kernels.cpu.build import build_library, cpu_flags

SOURCE = Path(__file__).with_name("attention.c")
CFLAGS = ["-O3", "-ffp-contract=off", "-mavx512f", "-mavx512bw", "-mavx512vl", "-fopenmp", "-fPIC", "-shared"]
MAX_HEAD_DIM = 256
MAX_GROUP = 16


@functools.cache
def _library() -> ctypes.CDLL | None:
    if not {"avx512f", "avx512bw", "avx512vl"} <= cpu_flags():
        return None
    lib = build_library("specdec_attention", [SOURCE], [SOURCE.with_name("bf16.h")], CFLAGS,
                        "CPU attention uses torch's SDPA, whose rounding changes with the window's shape")
    if lib is None:
        return None
    p, i64 = ctypes.c_void_p, ctypes.c_int64
    lib.specdec_paged_attention.argtypes = [p, i64, i64, i64, i64, ctypes.c_int, p, p, ctypes.c_int, i64, p, i64, p,
                                            p, i64, p, p, ctypes.c_float, p, ctypes.c_int]
    lib.specdec_paged_attention.restype = ctypes.c_int
    return lib


def available() -> bool:
    """True where the kernel builds and runs on this CPU (AVX-512, a C compiler, ``SPECDEC_NATIVE`` not 0)."""
    return _library() is not None


def supports_shape(head_dim: int, num_q_heads: int, num_kv_heads: int) -> bool:
    """The head layouts the kernel takes: a head dimension that is a multiple of 16 up to 256, at most 16 query heads
    per KV head."""
    return (head_dim % 16 == 0 and 0 < head_dim <= MAX_HEAD_DIM and num_kv_heads > 0
            and num_q_heads % num_kv_heads == 0 and num_q_heads // num_kv_heads <= MAX_GROUP)


def supports(q: torch.Tensor, k_cache: torch.Tensor) -> bool:
    """The tensors the kernel takes: CPU, q and the caches bf16 or fp32, a head layout ``supports_shape`` takes."""
    return (q.device.type == "cpu" and k_cache.device.type == "cpu" and q.dtype in (torch.bfloat16, torch.float32)
            and k_cache.dtype in (torch.bfloat16, torch.float32)
            and supports_shape(q.shape[-1], q.shape[1], k_cache.shape[2]))


def _check_metadata(num_tokens: int, block_size: int, tables: torch.Tensor, lens: torch.Tensor, cu: torch.Tensor,
                    mask: torch.Tensor | None, indptr: torch.Tensor | None) -> None:
    """The batch metadata the kernel trusts (host reads; CPU tensors): every row owned by one sequence, q_len <=
    seq_len, tables wide enough, tree slices of q_len * w entries with q_len <= w <= seq_len."""
    seq_lens, cu_l = lens.tolist(), cu.tolist()
    if len(cu_l) != len(seq_lens) + 1 or cu_l[0] != 0 or cu_l[-1] != num_tokens:
        raise ValueError(f"cu_q_lens {cu_l} does not cover the {num_tokens} query rows of {len(seq_lens)} sequences")
    if (mask is None) != (indptr is None):
        raise ValueError("tree_mask and tree_mask_indptr go together")
    ptr = indptr.tolist() if indptr is not None else None
    for b, ctx in enumerate(seq_lens):
        q_len = cu_l[b + 1] - cu_l[b]
        if not 0 <= q_len <= ctx or -(-ctx // block_size) > tables.shape[1]:
            raise ValueError(f"sequence {b}: {q_len} new tokens, context {ctx}, block table width {tables.shape[1]}")
        if ptr is not None and ptr[b + 1] > ptr[b]:
            size = ptr[b + 1] - ptr[b]
            if q_len == 0 or size % q_len or not q_len <= size // q_len <= ctx or ptr[b + 1] > mask.numel():
                raise ValueError(f"sequence {b}: a tree-mask slice of {size} entries for {q_len} rows, context {ctx}")


def _i32(t: torch.Tensor) -> torch.Tensor:
    return t.to(torch.int32).contiguous()


def paged_attention_invariant(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    cu_q_lens: torch.Tensor,
    scale: float,
    tree_mask: torch.Tensor | None = None,
    tree_mask_indptr: torch.Tensor | None = None,
    threads: int | None = None,
) -> torch.Tensor:
    """Paged attention, row-invariant. Shapes as ``paged_attention_reference``: ``q [T, Hq, D]``, caches
    ``[num_blocks, block_size, Hkv, D]``, ``block_tables`` int ``[B, max_blocks]``, ``seq_lens`` int ``[B]``,
    ``cu_q_lens`` int ``[B+1]``, optional packed ``tree_mask`` (bool / uint8) with ``tree_mask_indptr`` int
    ``[B+1]``. Returns ``[T, Hq, D]`` in q's dtype (computed in fp32)."""
    lib = _library()
    assert lib is not None, "native attention unavailable: check attention.available() first"
    if not supports(q, k_cache):
        raise ValueError(f"native attention takes bf16/fp32 CPU tensors with a head dim that is a multiple of 16 "
                         f"(<= {MAX_HEAD_DIM}) and <= {MAX_GROUP} query heads per KV head; got q {tuple(q.shape)} "
                         f"{q.dtype}, cache {tuple(k_cache.shape)} {k_cache.dtype}")
    q = q.contiguous()
    k_cache, v_cache = k_cache.contiguous(), v_cache.contiguous()
    num_tokens, hq, head_dim = q.shape
    _, block_size, hkv, _ = k_cache.shape
    tables, lens, cu = _i32(block_tables), _i32(seq_lens), _i32(cu_q_lens)
    mask = indptr = None
    if tree_mask is not None:
        mask = tree_mask.to(torch.uint8).contiguous()
        indptr = _i32(tree_mask_indptr) if tree_mask_indptr is not None else None
    _check_metadata(num_tokens, block_size, tables, lens, cu, mask, indptr)
    out = torch.empty_like(q)
    if num_tokens:
        rc = lib.specdec_paged_attention(
            q.data_ptr(), num_tokens, hq, hkv, head_dim, int(q.dtype == torch.bfloat16), k_cache.data_ptr(),
            v_cache.data_ptr(), int(k_cache.dtype == torch.bfloat16), block_size, tables.data_ptr(), tables.shape[1],
            lens.data_ptr(), cu.data_ptr(), lens.shape[0], None if mask is None else mask.data_ptr(),
            None if indptr is None else indptr.data_ptr(), float(scale), out.data_ptr(),
            threads or torch.get_num_threads())
        if rc != 0:
            raise MemoryError("native attention: could not allocate its scratch")
    return out
