"""KV compaction: the Triton kernel (interpreter on CPU) against the reference, bitwise; the reference against a
per-move oracle; overlapping move chains; moves across block boundaries; the engine's slot helper on a real
BlockManager; validation."""

import random

import pytest
import torch

from specdec import ops
from specdec.cache.block_manager import BlockManager
from specdec.kernels import kv_compact as kc
from specdec.kernels.kv_compact import kv_compact, kv_compact_reference
from specdec.spec_decode.accepted_path import accepted_path_moves

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def _skip_unless_runnable(device: str) -> None:
    if device == "cpu" and isinstance(kc._kv_copy_rows_kernel, kc.triton.runtime.JITFunction):
        pytest.skip("compiled Triton (TRITON_INTERPRET=0) cannot run on CPU tensors")


def make_pool(num_layers=3, num_blocks=6, block_size=4, num_kv_heads=2, head_dim=8, dtype=torch.float32,
              device="cpu", seed=0):  # fmt: skip
    """(k, v) like KVPool.tensors: [L, num_blocks, block_size, Hkv, D] of random values (distinct bits per slot)."""
    gen = torch.Generator().manual_seed(seed)
    shape = (num_layers, num_blocks, block_size, num_kv_heads, head_dim)
    return [torch.randn(shape, generator=gen).to(dtype).to(device) for _ in range(2)]


def oracle(caches, src, dst):
    """Expected caches, one slot at a time from a frozen copy of the inputs (gather-then-scatter by construction)."""
    expected = []
    for cache in caches:
        before = cache.clone()
        after = cache.clone()
        flat_before = before.view(*cache.shape[:-4], -1, *cache.shape[-2:])  # [..., slots, Hkv, D]
        flat_after = after.view(*cache.shape[:-4], -1, *cache.shape[-2:])
        for s, d in zip(src.tolist(), dst.tolist(), strict=True):
            flat_after[..., d, :, :] = flat_before[..., s, :, :]
        expected.append(after)
    return expected


def _slots(values, device):
    return torch.tensor(values, dtype=torch.int64, device=device)


def _assert_bitwise(actual, expected):
    for a, e in zip(actual, expected, strict=True):
        assert torch.equal(a.view(torch.uint8), e.view(torch.uint8))


def random_moves(num_slots: int, n: int, gen: random.Random):
    """n moves with distinct destinations; sources drawn from every slot, so many sources are destinations too."""
    dst = gen.sample(range(num_slots), n)
    src = [gen.randrange(num_slots) for _ in range(n)]
    return src, dst


# --------------------------------------------------------------------------------------------- reference


def test_reference_matches_the_per_move_oracle_on_a_chain():
    """Path nodes [1, 3, 4] of a tree rooted at position 5 (block size 4): moves 8 -> 7 and 9 -> 8 (slot 8 is both
    a destination and a source) cross from block 2 into block 1."""
    caches = make_pool()
    src, dst = _slots([8, 9], "cpu"), _slots([7, 8], "cpu")
    before = [c.clone() for c in caches]
    kv_compact_reference(caches, src, dst)
    _assert_bitwise(caches, oracle(before, src, dst))
    flat = [c.view(3, -1, 2, 8) for c in caches]
    flat_before = [c.view(3, -1, 2, 8) for c in before]
    assert torch.equal(flat[0][:, 7], flat_before[0][:, 8]) and torch.equal(flat[1][:, 8], flat_before[1][:, 9])


def test_reference_gathers_before_it_scatters():
    """A cycle 0 -> 1 -> 2 -> 0 only comes out right if every source is read before any destination is written."""
    caches = make_pool(num_layers=2, num_blocks=1)
    before = [c.clone() for c in caches]
    kv_compact_reference(caches, _slots([0, 1, 2], "cpu"), _slots([1, 2, 0], "cpu"))
    for c, b in zip(caches, before, strict=True):
        assert torch.equal(c[:, 0, [1, 2, 0]], b[:, 0, [0, 1, 2]])
        assert torch.equal(c[:, 0, 3], b[:, 0, 3])


def test_reference_on_per_layer_caches_equals_the_stacked_pool():
    """A list of 4-D per-layer tensors and the pool's two 5-D tensors are the same data: same result."""
    caches = make_pool(seed=3)
    per_layer = [c[layer].clone() for c in caches for layer in range(c.shape[0])]
    src, dst = _slots([1, 22, 5, 23], "cpu"), _slots([22, 0, 23, 9], "cpu")
    kv_compact_reference(caches, src, dst)
    kv_compact_reference(per_layer, src, dst)
    _assert_bitwise(per_layer, [c[layer] for c in caches for layer in range(c.shape[0])])


# ------------------------------------------------------------------------------------------------ kernel


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_kernel_matches_reference_bitwise(dtype, device):
    """Random overlapping moves (sources that are other moves' destinations) over 24 slots, block size 4."""
    _skip_unless_runnable(device)
    rng = random.Random(1)
    for trial, n in enumerate([1, 5, 13, 24]):
        caches = make_pool(num_kv_heads=3, head_dim=12, dtype=dtype, device=device, seed=trial)  # W = 36
        src, dst = (_slots(x, device) for x in random_moves(24, n, rng))
        expected = [c.clone() for c in caches]
        kv_compact_reference(expected, src, dst)
        kv_compact(caches, src, dst)
        _assert_bitwise(caches, expected)
        _assert_bitwise(expected, oracle(make_pool(num_kv_heads=3, head_dim=12, dtype=dtype, device=device,
                                                   seed=trial), src, dst))  # fmt: skip


@pytest.mark.parametrize("device", DEVICES)
def test_kernel_moves_a_tree_path_across_blocks_and_many_programs(device):
    """Three requests' accepted paths in one call (a wide row, W = 2 * 1024 > one program's BLOCK_W, and more moves
    than one program's BLOCK_T), every path crossing a block boundary; all other slots untouched."""
    _skip_unless_runnable(device)
    caches = make_pool(num_layers=2, num_blocks=12, block_size=4, num_kv_heads=2, head_dim=1024, device=device)
    # request A: root at slot 2 (block 0), path nodes [1, 3, 4, 6] -> moves 5->3, 6->4, 8->5 (blocks 1, 2)
    # request B: blocks 5, 3 in that order (logical pos p -> slot 20 + p for p < 4, 12 + p - 4 after)
    # root at pos 1, path [2, 5] -> pos 3 -> 2 (20 + 3 -> 20 + 2), pos 6 -> 3 (block 3: slot 14 -> slot 23)
    # request C: one move inside block 10 (42 -> 41)
    src = _slots([5, 6, 8, 23, 14, 42], device)
    dst = _slots([3, 4, 5, 22, 23, 41], device)
    before = [c.clone() for c in caches]
    kv_compact(caches, src, dst)
    _assert_bitwise(caches, oracle(before, src, dst))
    moved = torch.zeros(48, dtype=torch.bool)
    moved[dst.cpu()] = True
    for c, b in zip(caches, before, strict=True):
        flat, flat_b = c.view(2, 48, -1), b.view(2, 48, -1)
        assert torch.equal(flat[:, ~moved.to(device)], flat_b[:, ~moved.to(device)])


@pytest.mark.parametrize("device", DEVICES)
def test_empty_move_list_is_a_no_op(device):
    _skip_unless_runnable(device)
    caches = make_pool(device=device)
    before = [c.clone() for c in caches]
    empty = _slots([], device)
    kv_compact(caches, empty, empty)
    kv_compact_reference(caches, empty, empty)
    _assert_bitwise(caches, before)


def test_ops_dispatch_runs_the_kernel_when_forced(monkeypatch):
    caches = make_pool()
    src, dst = _slots([8, 9], "cpu"), _slots([7, 8], "cpu")
    expected = [c.clone() for c in caches]
    kv_compact_reference(expected, src, dst)
    calls = []
    monkeypatch.setattr(kc, "kv_compact", lambda *a: (calls.append("triton"), kv_compact(*a)))
    ops.kv_compact(caches, src, dst)  # CPU tensors: the reference
    assert calls == []
    _assert_bitwise(caches, expected)
    caches = make_pool()
    with ops.force_triton():
        ops.kv_compact(caches, src, dst)
    assert calls == ["triton"]
    _assert_bitwise(caches, expected)


# ------------------------------------------------------------------------------------ the engine's helper


def test_accepted_path_moves_on_a_block_manager_across_block_boundaries():
    """Real BlockManager, block size 4, blocks out of physical order: a tree rooted at position 6 (logical block
    1, offset 2) with 7 nodes at positions 6..12; the accepted path [2, 3, 6] lands at positions 7, 8, 9 (logical
    blocks 1 and 2), and moving the cache with those slots gives the K/V a chain would have had."""
    bm = BlockManager(num_blocks=8, block_size=4)
    bm.allocate(99, 5)  # another sequence takes blocks 0, 1
    bm.allocate(7, 6)  # ours: blocks 2, 3
    bm.free(99)
    bm.allocate(98, 16)  # blocks 4..7
    bm.append_slots(7, 7)  # the tree: 13 slots in all, the new blocks are 0 and 1 (in the manager's order)
    assert bm.block_table(7)[:2] == [2, 3] and sorted(bm.block_table(7)[2:]) == [0, 1] and bm.seq_len(7) == 13
    src, dst = accepted_path_moves(bm, 7, ctx=6, accepted_nodes=[2, 3, 6])
    assert src == [bm.slot(7, 8), bm.slot(7, 9), bm.slot(7, 12)]
    assert dst == [bm.slot(7, 7), bm.slot(7, 8), bm.slot(7, 9)]
    assert bm.slot(7, 7) // 4 != bm.slot(7, 12) // 4  # the move crosses blocks
    # the cache: each logical position p of sequence 7 holds the value p (every layer, every head dim)
    caches = [torch.full((2, 8, 4, 1, 3), -1.0) for _ in range(2)]
    for c in caches:
        for p in range(13):
            c.view(2, 32, 1, 3)[:, bm.slot(7, p)] = float(p)
    ops.kv_compact(caches, _slots(src, "cpu"), _slots(dst, "cpu"))
    for c in caches:
        values = [c.view(2, 32, 1, 3)[0, bm.slot(7, p), 0, 0].item() for p in range(10)]
        assert values == [0, 1, 2, 3, 4, 5, 6, 8, 9, 12]  # context + root, then nodes 2, 3, 6
    assert bm.truncate_to(7, 10) == 1  # the rest of the tree's blocks go back
    bm.check_invariants()


def test_accepted_path_moves_leaves_out_moves_in_place():
    bm = BlockManager(num_blocks=4, block_size=4)
    bm.allocate(1, 10)
    assert accepted_path_moves(bm, 1, ctx=3, accepted_nodes=[1, 2, 3]) == ([], [])  # a chain: nothing moves
    assert accepted_path_moves(bm, 1, ctx=3, accepted_nodes=[]) == ([], [])
    assert accepted_path_moves(bm, 1, ctx=3, accepted_nodes=[1, 2, 5]) == ([8], [6])


@pytest.mark.parametrize("nodes,ctx,message", [
    ([0, 1], 3, "strictly increasing node indices >= 1"),
    ([2, 2], 3, "strictly increasing"),
    ([3, 1], 3, "strictly increasing"),
    ([1, 7], 3, "beyond the sequence's 10 reserved slots"),
    ([1], 10, r"ctx \(the root's position\) must lie in \[0, seq_len = 10\)"),
])  # fmt: skip
def test_accepted_path_moves_rejects_bad_paths(nodes, ctx, message):
    bm = BlockManager(num_blocks=4, block_size=4)
    bm.allocate(1, 10)
    with pytest.raises(ValueError, match=message):
        accepted_path_moves(bm, 1, ctx=ctx, accepted_nodes=nodes)
    with pytest.raises(ValueError, match="has no blocks"):
        accepted_path_moves(bm, 2, ctx=0, accepted_nodes=[])


# --------------------------------------------------------------------------------------------- validation


def _valid():
    return make_pool(), _slots([8, 9], "cpu"), _slots([7, 8], "cpu")


INVALID = {
    "equal lengths": lambda c, s, d: (c, s, d[:1]),
    r"must lie in \[0, num_blocks \* block_size = 24\)": lambda c, s, d: (c, s + 20, d),
    "dst_slots must lie in": lambda c, s, d: (c, s, d - 8),
    "dst_slots must be distinct": lambda c, s, d: (c, s, _slots([7, 7], "cpu")),
    "must be a contiguous 1-d int64": lambda c, s, d: (c, s.int(), d),
    "dst_slots must be a contiguous 1-d int64": lambda c, s, d: (c, s, d[None]),
    "shape, dtype and device": lambda c, s, d: ([c[0], c[1].half()], s, d),
    r"caches\[1\] has \(\(2, 6": lambda c, s, d: ([c[0], c[1][:2].contiguous()], s, d),
    r"caches\[0\] must be \[\.\.\., num_blocks": lambda c, s, d: ([c[0][0, 0]], s, d),
    r"caches\[0\] must be contiguous": lambda c, s, d: ([c[0].transpose(0, 1)], s, d),
    "non-empty list/tuple": lambda c, s, d: ([], s, d),
    "the same tensor twice": lambda c, s, d: ([c[0], c[0]], s, d),
    "src_slots must be a torch.Tensor": lambda c, s, d: (c, [8, 9], d),
}


@pytest.mark.parametrize("impl", [kv_compact, kv_compact_reference], ids=["kernel", "reference"])
@pytest.mark.parametrize("message", list(INVALID))
def test_bad_inputs_raise_and_leave_the_caches_alone(message, impl):
    caches, src, dst = _valid()
    before = [c.clone() for c in caches]
    with pytest.raises(ValueError, match=message):
        impl(*INVALID[message](caches, src, dst))
    _assert_bitwise(caches, before)


def test_a_single_tensor_is_not_a_list_of_caches():
    caches, src, dst = _valid()
    with pytest.raises(ValueError, match="non-empty list/tuple"):
        kv_compact_reference(caches[0], src, dst)
