"""The row-invariant CPU attention (``specdec.kernels.cpu.attention``, issue 33): a query row's output is the same
bit for bit as a decode, as a row of a verification window, as a row of a tree window (against the decode of its
path), as a row of a prefill chunk and as a row in a batch of 64 sequences, whatever the thread count; and it is
attention (the SDPA reference within float rounding). ``test_the_check_catches_sdpa`` runs the window check on the
reference path (torch's SDPA, the CPU path before) and sees it fail: the check can fail.
"""

from __future__ import annotations

import pytest
import torch

from specdec.kernels.cpu import attention
from specdec.kernels.paged_attention_reference import paged_attention_reference

pytestmark = pytest.mark.skipif(not attention.available(), reason="no AVX-512 on this CPU (or no C compiler)")

BLOCK = 4
HQ, HKV, D = 6, 2, 32


def pool(num_blocks, dtype, seed):
    gen = torch.Generator().manual_seed(seed)
    k = torch.randn(num_blocks, BLOCK, HKV, D, generator=gen).to(dtype)
    v = torch.randn(num_blocks, BLOCK, HKV, D, generator=gen).to(dtype)
    return k, v


def i32(values):
    return torch.tensor(values, dtype=torch.int32)


def attend(q, k, v, tables, lens, q_lens, mask=None, indptr=None, threads=None, fn=None):
    cu = i32([0] + torch.tensor(q_lens).cumsum(0).tolist())
    if fn is None:
        return attention.paged_attention_invariant(q, k, v, tables, i32(lens), cu, D**-0.5, mask, indptr, threads)
    return fn(q, k, v, tables, i32(lens), cu, D**-0.5, mask, indptr)


def decodes_of_window(q, k, v, table, ctx, q_len, fn=None):
    """Each of the window's rows as its own decode: row i at context length ctx - q_len + i + 1."""
    return torch.cat([attend(q[i : i + 1], k, v, table, [ctx - q_len + i + 1], [1], fn=fn) for i in range(q_len)])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_a_window_row_equals_its_decode(dtype):
    k, v = pool(40, dtype, 0)
    table = torch.randperm(40, generator=torch.Generator().manual_seed(1)).to(torch.int32)[None]  # scattered blocks
    q = torch.randn(5, HQ, D, generator=torch.Generator().manual_seed(2)).to(dtype)
    for ctx in (5, 23, 150):
        window = attend(q, k, v, table, [ctx], [5])
        assert torch.equal(window, decodes_of_window(q, k, v, table, ctx, 5))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_a_row_in_a_batch_of_64_equals_the_row_alone(dtype):
    k, v = pool(64 * 8, dtype, 3)
    gen = torch.Generator().manual_seed(4)
    tables = torch.randperm(64 * 8, generator=gen).to(torch.int32).view(64, 8)
    lens = torch.randint(1, 8 * BLOCK + 1, (64,), generator=gen).tolist()
    q_lens = [min(n, int(torch.randint(1, 6, (1,), generator=gen))) for n in lens]  # decodes and windows mixed
    q = torch.randn(sum(q_lens), HQ, D, generator=gen).to(dtype)
    batch = attend(q, k, v, tables, lens, q_lens)
    start = 0
    for b in range(64):
        rows = slice(start, start + q_lens[b])
        assert torch.equal(attend(q[rows], k, v, tables[b : b + 1], [lens[b]], [q_lens[b]]), batch[rows])
        start += q_lens[b]
    assert torch.equal(attend(q, k, v, tables, lens, q_lens, threads=1), attend(q, k, v, tables, lens, q_lens,
                                                                               threads=3))


def test_a_prefill_chunk_row_equals_its_decode():
    k, v = pool(64, torch.bfloat16, 5)
    table = torch.arange(64, dtype=torch.int32)[None]
    q = torch.randn(100, HQ, D, generator=torch.Generator().manual_seed(6)).bfloat16()
    chunk = attend(q, k, v, table, [180], [100])  # a second chunk: 80 tokens already cached
    for i in (0, 1, 50, 99):
        assert torch.equal(attend(q[i : i + 1], k, v, table, [80 + i + 1], [1]), chunk[i : i + 1])


def test_a_tree_row_equals_the_decode_of_its_path():
    """A tree window over context 13: node i's row sees the context and its ancestors, which sit among its
    siblings' slots; its decode sees the same keys laid out as one contiguous path."""
    ctx_before, parents = 13, [-1, 0, 0, 1, 1, 2, 3]  # node 0 the root (the window's first row)
    w = len(parents)
    k, v = pool(40, torch.bfloat16, 7)
    table = torch.arange(0, 20, dtype=torch.int32)[None]
    q = torch.randn(w, HQ, D, generator=torch.Generator().manual_seed(8)).bfloat16()
    mask = torch.zeros(w, w, dtype=torch.bool)
    for i in range(w):
        j = i
        while j >= 0:
            mask[i, j] = True
            j = parents[j]
    tree = attend(q, k, v, table, [ctx_before + w], [w], mask.flatten(), i32([0, w * w]))
    for i in range(w):
        path = [j for j in range(w) if mask[i, j]]  # ancestors then the node, in slot order
        # a second sequence: the context's blocks copied, then the path's K/V in consecutive slots
        k2, v2 = k.clone(), v.clone()
        flat_k, flat_v = k2.view(-1, HKV, D), v2.view(-1, HKV, D)
        base = 20 * BLOCK  # blocks 20.. hold the copy
        flat_k[base : base + ctx_before] = k.view(-1, HKV, D)[:ctx_before]
        flat_v[base : base + ctx_before] = v.view(-1, HKV, D)[:ctx_before]
        for depth, j in enumerate(path):
            flat_k[base + ctx_before + depth] = k.view(-1, HKV, D)[ctx_before + j]
            flat_v[base + ctx_before + depth] = v.view(-1, HKV, D)[ctx_before + j]
        decode = attend(q[i : i + 1], k2, v2, torch.arange(20, 40, dtype=torch.int32)[None],
                        [ctx_before + len(path)], [1])
        assert torch.equal(decode, tree[i : i + 1]), i


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_it_is_attention(dtype):
    k, v = pool(64, dtype, 9)
    gen = torch.Generator().manual_seed(10)
    tables = torch.randperm(64, generator=gen).to(torch.int32).view(4, 16)
    lens, q_lens = [30, 64, 7, 50], [1, 5, 7, 20]
    q = torch.randn(sum(q_lens), HQ, D, generator=gen).to(dtype)
    mask = torch.tensor([1, 0, 0, 0, 0, 1, 1, 0, 1, 1, 0, 1, 1, 0, 1, 1, 1, 0, 1, 1, 0, 1, 0, 0, 1], dtype=torch.bool)
    indptr = i32([0, 0, 25, 25, 25])  # sequence 1: a 5-node tree; the others causal
    got = attend(q, k, v, tables, lens, q_lens, mask, indptr)
    want = attend(q, k, v, tables, lens, q_lens, mask, indptr, fn=paged_attention_reference)
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(got.float(), want.float(), atol=tol, rtol=tol)


def test_unsupported_shapes_are_refused():
    k, v = pool(4, torch.float32, 0)
    with pytest.raises(ValueError, match="multiple of 16"):
        attention.paged_attention_invariant(torch.zeros(1, HQ, 8), k[..., :8], v[..., :8], i32([[0]]), i32([1]),
                                            i32([0, 1]), 1.0)


def test_the_check_catches_sdpa():
    """The reference path (torch's SDPA, the CPU attention before): a float32 window's rows are not its decodes'."""
    k, v = pool(40, torch.float32, 0)
    table = torch.randperm(40, generator=torch.Generator().manual_seed(1)).to(torch.int32)[None]
    q = torch.randn(5, HQ, D, generator=torch.Generator().manual_seed(2))
    window = attend(q, k, v, table, [150], [5], fn=paged_attention_reference)
    assert not torch.equal(window, decodes_of_window(q, k, v, table, 150, 5, fn=paged_attention_reference))


def test_bad_metadata_is_refused_before_the_kernel_reads_it():
    k, v = pool(8, torch.float32, 0)
    q = torch.randn(5, HQ, D)
    table = torch.arange(8, dtype=torch.int32)[None]
    for lens, q_lens, tables, match in (
        ([40], [4], table, "cover"),  # cu_q_lens ends at 4, q has 5 rows
        ([3], [5], table, "new tokens"),  # more new tokens than context
        ([40], [5], table[:, :2], "block table width"),  # a table too narrow for 40 keys
    ):
        cu = i32([0] + torch.tensor(q_lens).cumsum(0).tolist())
        with pytest.raises(ValueError, match=match):
            attention.paged_attention_invariant(q, k, v, tables, i32(lens), cu, 1.0)
    with pytest.raises(ValueError, match="tree-mask slice"):  # a 5-row tree over 7 keys of a 6-key context
        attention.paged_attention_invariant(q, k, v, table, i32([6]), i32([0, 5]), 1.0,
                                            torch.ones(35, dtype=torch.bool), i32([0, 35]))


def test_ops_refuses_rather_than_falls_back():
    """``ops.paged_attention(invariant=True)`` with tensors the kernel cannot take is an error, never a silent
    switch to the SDPA path (which would lose the guarantee)."""
    from specdec import ops

    k, v = pool(4, torch.float32, 0)
    with pytest.raises(ValueError, match="row-invariant attention"):
        ops.paged_attention(torch.zeros(1, HQ, 8), k[..., :8].contiguous(), v[..., :8].contiguous(), i32([[0]]),
                            i32([1]), i32([0, 1]), 1.0, invariant=True)
