"""Persistent step state: the staging buffer (its host slots used in turn), the block manager's incremental
``table_array`` / ``read_only``, and ``ModelRunner.prepare`` against a reference that builds the metadata from
Python lists the way the runner did before (one ``torch.tensor`` per array, ``bm.slot`` per token, the tree masks
concatenated on their own) - and without any construct that synchronises the stream on CUDA."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch
from runner_helpers import random_batch, reference_metadata, same_tensor, tree_mask_batch
from torch.overrides import TorchFunctionMode

from specdec.cache.block_manager import INITIAL_TABLE_ROWS, INITIAL_TABLE_WIDTH, BlockManager
from specdec.runner.model_runner import ForwardItem, ModelRunner
from specdec.runner.staging import StagingBuffer


# --- the staging buffer ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("separate", [False, True])
def test_sections_round_trip_with_their_dtypes(separate):
    buf = StagingBuffer("cpu", initial_bytes=64, separate_device_buffer=separate)
    a, b, c, d = buf.stage([(3, np.int64), (5, np.int32), (1, np.int32), (2, np.int64)])
    a[:] = [1, -2, 3]
    b[:] = [4, 5, 6, 7, 8]
    c[:] = [-1]
    d[:] = [2**40, 9]
    ta, tb, tc, td = buf.to_device()
    assert [t.dtype for t in (ta, tb, tc, td)] == [torch.int64, torch.int32, torch.int32, torch.int64]
    assert ta.tolist() == [1, -2, 3] and tb.tolist() == [4, 5, 6, 7, 8] and tc.tolist() == [-1]
    assert td.tolist() == [2**40, 9]
    assert buf.num_copies == (1 if separate else 0)  # the one copy per forward, or none (the host memory)
    a[0] = 100  # the host side of the next stage: a separate device buffer keeps what was copied
    assert ta[0] == (1 if separate else 100)


@pytest.mark.parametrize("separate", [False, True])
def test_the_buffer_grows_geometrically_and_a_stage_overwrites_the_last(separate):
    buf = StagingBuffer("cpu", initial_bytes=64, separate_device_buffer=separate)
    grows = buf.num_grows
    for n in range(1, 2000, 7):  # ever larger stages: capacity doubles, so only O(log n) reallocations
        (x,) = buf.stage([(n, np.int64)])
        x[:] = np.arange(n)
        (t,) = buf.to_device()
        assert t.tolist() == list(range(n))
    assert buf.capacity >= 8 * 1994 and buf.num_grows - grows <= 9
    (x,) = buf.stage([(1, np.int64)])  # smaller again: no growth, same memory
    x[:] = 5
    assert buf.to_device()[0].tolist() == [5] and buf.num_grows - grows <= 9


def test_an_empty_section_is_an_empty_tensor():
    buf = StagingBuffer("cpu")
    a, b = buf.stage([(0, np.int64), (2, np.int32)])
    b[:] = [1, 2]
    ta, tb = buf.to_device()
    assert ta.shape == (0,) and tb.tolist() == [1, 2]


def _address(view: np.ndarray) -> int:
    return view.__array_interface__["data"][0]


@pytest.mark.parametrize("separate", [False, True])
def test_slots_alternate_and_staging_the_next_forward_leaves_the_last_ones_memory_alone(separate):
    buf = StagingBuffer("cpu", initial_bytes=256, separate_device_buffer=separate)
    assert buf.num_slots == 2
    staged, slots = [], []
    for n in range(6):
        a, b = buf.stage([(3, np.int64), (2, np.int32)])
        slots.append(buf.slot)
        a[:] = [n, n + 1, n + 2]
        b[:] = [-n, 7]
        if n:  # forward n - 1's host views and its tensors still hold what it staged, n's host side filled
            (pa, pb), (ta, tb) = staged[n - 1]
            assert pa.tolist() == [n - 1, n, n + 1] and pb.tolist() == [1 - n, 7]
            assert ta.tolist() == [n - 1, n, n + 1] and tb.tolist() == [1 - n, 7]
            assert not np.shares_memory(pa, a) and not np.shares_memory(pb, b)
        staged.append(((a, b), buf.to_device()))
        if n and not separate:  # the host memory itself: forward n - 1's tensors outlive forward n's copy too
            assert staged[n - 1][1][0].tolist() == [n - 1, n, n + 1]
    assert slots == [0, 1, 0, 1, 0, 1]
    assert len({_address(h[0]) for (h, _) in staged[0::2]}) == 1  # a slot is reused in place (no growth here)
    assert _address(staged[0][0][0]) != _address(staged[1][0][0])
    assert buf.num_grows == 1 and buf.num_copies == (6 if separate else 0)


def test_one_slot_is_the_old_single_buffer():
    buf = StagingBuffer("cpu", initial_bytes=64, num_slots=1)
    (a,) = buf.stage([(2, np.int64)])
    (b,) = buf.stage([(2, np.int64)])
    assert buf.slot == 0 and np.shares_memory(a, b)
    with pytest.raises(ValueError, match="num_slots"):
        StagingBuffer("cpu", num_slots=0)


@pytest.mark.parametrize("separate", [False, True])
def test_a_grow_keeps_every_slot_correct(separate):
    """Growth while another slot holds the previous forward: that forward's views keep their values, a slot
    smaller than the new capacity gets fresh memory when it is next used, and every stage lands whole."""
    buf = StagingBuffer("cpu", initial_bytes=64, separate_device_buffer=separate)
    (small,) = buf.stage([(4, np.int64)])  # slot 0
    small[:] = [1, 2, 3, 4]
    (t_small,) = buf.to_device()
    big_n = 1000
    (big,) = buf.stage([(big_n, np.int64)])  # slot 1: grows
    assert buf.slot == 1 and buf.num_grows == 2 and buf.capacity >= 8 * big_n
    big[:] = np.arange(big_n)
    (t_big,) = buf.to_device()
    assert small.tolist() == [1, 2, 3, 4] and t_small.tolist() == [1, 2, 3, 4]  # forward N untouched
    assert t_big.tolist() == list(range(big_n))
    (again, more) = buf.stage([(big_n - 10, np.int64), (3, np.int32)])  # slot 0 again: reallocated at the capacity
    assert buf.slot == 0 and not np.shares_memory(again, small) and buf.num_grows == 2
    again[:] = np.arange(big_n - 10)[::-1]
    more[:] = [5, 6, 7]
    t_again, t_more = buf.to_device()
    assert t_again.tolist() == list(range(big_n - 10))[::-1] and t_more.tolist() == [5, 6, 7]
    if not separate:  # (separate: one device buffer, which the next copy overwrites in stream order)
        assert t_big.tolist() == list(range(big_n))
    assert small.tolist() == [1, 2, 3, 4]  # the old memory lives on with its views
    (last,) = buf.stage([(big_n, np.int64)])  # slot 1: already at the capacity, reused in place
    assert buf.slot == 1 and np.shares_memory(last, big) and buf.num_grows == 2


class _FakeCopyEvent:
    """Stands in for a slot's ``torch.cuda.Event`` (no GPU here): a recorded copy lands when the test says so."""

    def __init__(self):
        self.recorded = self.done = False
        self.waited = 0

    def record(self):
        self.recorded, self.done = True, False

    def query(self) -> bool:
        return self.done or not self.recorded

    def synchronize(self):
        self.waited += 1
        self.done = True


def test_a_stage_waits_only_for_the_copy_made_from_its_own_slot():
    buf = StagingBuffer("cpu", initial_bytes=256, separate_device_buffer=True)
    events = buf._events = [_FakeCopyEvent(), _FakeCopyEvent()]
    buf.stage([(4, np.int64)])
    buf.to_device()  # copy 1 from slot 0, not landed
    buf.stage([(4, np.int64)])  # slot 1: does not wait for copy 1 (the single buffer did)
    assert buf.slot == 1 and events[0].waited == 0 and buf.num_waits == 0
    buf.to_device()  # copy 2 from slot 1
    buf.stage([(4, np.int64)])  # slot 0 again: copy 1 must land before its memory is rewritten
    assert buf.slot == 0 and events[0].waited == 1 and buf.num_waits == 1
    buf.to_device()
    events[1].done = True  # copy 2 has landed: no wait
    buf.stage([(4, np.int64)])
    assert buf.slot == 1 and events[1].waited == 0 and buf.num_waits == 1
    buf.to_device()
    events[0].done = True
    buf.stage([(10_000, np.int64)])  # a grow: slot 0 gets fresh memory, nothing to wait for
    assert buf.slot == 0 and events[0].waited == 1 and buf.num_waits == 1

    one = StagingBuffer("cpu", initial_bytes=256, separate_device_buffer=True, num_slots=1)
    one._events = [_FakeCopyEvent()]
    one.stage([(4, np.int64)])
    one.to_device()
    one.stage([(4, np.int64)])  # one slot: every stage waits for the previous copy
    assert one._events[0].waited == 1 and one.num_waits == 1


def test_bool_and_uint8_sections_after_int_runs():
    buf = StagingBuffer("cpu", initial_bytes=64, separate_device_buffer=True)
    a, b, m, u = buf.stage([(1, np.int64), (3, np.int32), (5, np.bool_), (2, np.uint8)])
    a[:] = [9]
    b[:] = [1, 2, 3]
    m[:] = [True, False, True, True, False]
    u[:] = [255, 1]
    ta, tb, tm, tu = buf.to_device()
    assert tm.dtype == torch.bool and tm.tolist() == [True, False, True, True, False] and tm.is_contiguous()
    assert tu.dtype == torch.uint8 and tu.tolist() == [255, 1] and ta.tolist() == [9] and tb.tolist() == [1, 2, 3]
    with pytest.raises(TypeError, match="int64, int32, bool or uint8"):
        buf.stage([(1, np.float32)])


# --- the block manager's persistent table ----------------------------------------------------------------------
def _row(bm: BlockManager, seq_id: int) -> list[int]:
    return bm.table_array[bm.row_of(seq_id)].tolist()


def test_appends_and_rollbacks_across_page_boundaries_update_the_row_in_place():
    bm = BlockManager(40, 4)
    bm.allocate(0, 3)  # 1 block
    table = bm.block_table(0)
    assert _row(bm, 0)[:2] == [table[0], 0]
    bm.append_slots(0, 6)  # 9 slots: 3 blocks
    assert _row(bm, 0)[:4] == bm.block_table(0) + [0]
    bm.truncate_to(0, 5)  # rollback across a page boundary: the third block is given back, its entry zeroed
    assert len(bm.block_table(0)) == 2 and _row(bm, 0)[:3] == bm.block_table(0) + [0]
    bm.truncate_to(0, 4)  # exactly one block
    assert _row(bm, 0)[:2] == bm.block_table(0) + [0]
    bm.append_slots(0, 4 * INITIAL_TABLE_WIDTH)  # beyond the initial width: the array widens, the row survives
    assert bm.table_array.shape[1] >= len(bm.block_table(0)) > INITIAL_TABLE_WIDTH
    assert _row(bm, 0)[: len(bm.block_table(0))] == bm.block_table(0)
    bm.check_invariants()
    bm.free(0)
    assert not bm.table_array.any()
    bm.check_invariants()


def test_rows_grow_when_more_sequences_hold_blocks_and_freed_rows_are_reused():
    bm = BlockManager(200, 2)
    for s in range(3 * INITIAL_TABLE_ROWS):
        bm.allocate(s, 1 + s % 5)
    assert bm.table_array.shape[0] >= 3 * INITIAL_TABLE_ROWS
    for s in range(3 * INITIAL_TABLE_ROWS):
        assert _row(bm, s)[: len(bm.block_table(s))] == bm.block_table(s)
    bm.check_invariants()
    rows = bm.table_array.shape[0]
    old_row = bm.row_of(5)
    bm.free(5)  # a preemption: blocks and row given back
    assert not bm.table_array[old_row].any()
    bm.allocate(100, 7)  # the freed row is taken again, no growth
    assert bm.row_of(100) == old_row and bm.table_array.shape[0] == rows
    assert _row(bm, 100)[:5] == bm.block_table(100) + [0]
    bm.check_invariants()


def test_try_reserve_grows_a_sequence_or_changes_nothing():
    bm = BlockManager(3, 4)
    bm.allocate(0, 3)
    assert bm.try_reserve(0, 2) and bm.seq_len(0) == 3  # already long enough
    assert bm.try_reserve(0, 4) and bm.seq_len(0) == 4 and len(bm.block_table(0)) == 1  # within its block
    assert bm.try_reserve(0, 9) and len(bm.block_table(0)) == 3  # two new blocks, in the row too
    assert _row(bm, 0)[:4] == bm.block_table(0) + [0]
    assert not bm.try_reserve(0, 13) and bm.seq_len(0) == 9 and len(bm.block_table(0)) == 3  # pool exhausted
    bm.check_invariants()


def test_read_only_marks_shared_and_registered_prefix_blocks():
    bm = BlockManager(16, 4, enable_prefix_caching=True)
    prompt = list(range(10, 20))  # 2 full blocks + 2 tokens
    bm.allocate(0, 10, prompt)
    own = bm.block_table(0)
    assert not bm.read_only[own].any()  # held by sequence 0 alone, nothing registered yet
    bm.register_committed(0, prompt)
    assert bm.read_only[own].tolist() == [True, True, False]  # the two registered blocks are never written
    assert bm.allocate(1, 10, prompt) == 8  # shares both
    shared = bm.block_table(1)
    assert shared[:2] == own[:2] and _row(bm, 1)[:3] == shared
    assert bm.read_only[shared].tolist() == [True, True, False]
    bm.check_invariants()
    bm.free(0)
    bm.free(1)
    assert bm.read_only.all()  # nothing is held: no block may be written
    bm.check_invariants()


def test_random_operations_keep_the_array_equal_to_the_lists():
    rng = random.Random(0)
    for block_size in (1, 3, 4):
        bm = BlockManager(64, block_size, enable_prefix_caching=True)
        tokens: dict[int, list[int]] = {}
        for _ in range(400):
            op, seq = rng.choice(["alloc", "append", "truncate", "free", "register"]), rng.randrange(12)
            if op == "alloc" and seq not in tokens:
                ids = [rng.randrange(3) for _ in range(rng.randrange(1, 20))]  # few ids: prefixes repeat
                if bm.can_allocate(len(ids), ids):
                    bm.allocate(seq, len(ids), ids)
                    tokens[seq] = ids
            elif op == "append" and seq in tokens:
                n = rng.randrange(1, 9)
                if bm.can_append(seq, n):
                    bm.append_slots(seq, n)
                    tokens[seq] += [rng.randrange(3) for _ in range(n)]
            elif op == "truncate" and seq in tokens:
                low = bm.num_chained_blocks(seq) * block_size
                new_len = rng.randint(low, bm.seq_len(seq))
                bm.truncate_to(seq, new_len)
                del tokens[seq][new_len:]
            elif op == "register" and seq in tokens:
                bm.register_committed(seq, tokens[seq])
            elif op == "free" and seq in tokens:
                bm.free(seq)
                del tokens[seq]
            bm.check_invariants()  # table_array == the lists (zeros beyond), read_only == slot's rule


# --- ModelRunner.prepare against the list-built reference ------------------------------------------------------
def _prepared(runner: ModelRunner, items: list[ForwardItem]) -> dict[str, torch.Tensor]:
    meta, ids, positions, logits_indices = runner.prepare(items)
    assert meta.tree_mask is None if all(it.mask is None for it in items) else meta.tree_mask is not None
    return {"input_ids": ids, "positions": positions, "slot_mapping": meta.slot_mapping,
            "logits_indices": logits_indices, "block_tables": meta.block_tables, "seq_lens": meta.seq_lens,
            "cu_q_lens": meta.cu_q_lens, "tree_mask": meta.tree_mask, "tree_mask_indptr": meta.tree_mask_indptr}


@pytest.mark.parametrize("separate", [False, True])  # True: through the copy a CUDA device makes
@pytest.mark.parametrize("block_size", [1, 4, 16])
def test_prepare_equals_the_list_built_metadata_on_random_ragged_batches(block_size, separate):
    rng = random.Random(block_size)
    bm = BlockManager(4096, block_size)
    runner = ModelRunner(None, None, bm, torch.device("cpu"))
    runner.staging = StagingBuffer("cpu", initial_bytes=64, separate_device_buffer=separate)
    seqs: dict[int, int] = {}  # seq id -> tokens computed
    next_id = 0
    for _ in range(60):
        while len(seqs) < rng.randint(1, 20):  # arrivals
            seqs[next_id] = 0
            bm.allocate(next_id, rng.randint(1, 30))
            next_id += 1
        items = random_batch(rng, bm, seqs)
        expected = reference_metadata(items, bm)
        got = _prepared(runner, items)
        for name, tensor in expected.items():
            assert same_tensor(got[name], tensor), name
        for item in items:  # commit some tokens, roll the rest back (often across a page boundary)
            seqs[item.seq_id] = item.start_pos + rng.randint(0, len(item.token_ids))
            bm.truncate_to(item.seq_id, max(seqs[item.seq_id], bm.seq_len(item.seq_id) - rng.randint(0, 9)))
        for seq_id in rng.sample(sorted(seqs), rng.randint(0, 2)):  # finished or preempted: blocks given back
            bm.free(seq_id)
            del seqs[seq_id]
        bm.check_invariants()


def test_prepare_with_input_ids_stages_no_ids():
    bm = BlockManager(8, 4)
    bm.allocate(0, 6)
    runner = ModelRunner(None, None, bm, torch.device("cpu"))
    meta, ids, positions, logits_indices = runner.prepare([ForwardItem(0, [1, 2], 4, 2)], with_ids=False)
    assert ids is None and positions.tolist() == [4, 5] and logits_indices.tolist() == [0, 1]
    assert meta.slot_mapping.tolist() == [bm.block_table(0)[1] * 4, bm.block_table(0)[1] * 4 + 1]


def test_a_write_into_a_shared_prefix_block_is_refused_before_anything_runs():
    bm = BlockManager(16, 4, enable_prefix_caching=True)
    prompt = list(range(10, 20))
    bm.allocate(0, 10, prompt)
    bm.register_committed(0, prompt)
    bm.allocate(1, 10, prompt)  # shares the two registered blocks
    runner = ModelRunner(None, None, bm, torch.device("cpu"))
    assert runner.prepare([ForwardItem(1, [0, 0], 8, 1)])  # its own third block: fine
    with pytest.raises(RuntimeError, match="refusing to write position 7 of sequence 1"):
        runner.prepare([ForwardItem(0, [5], 9, 1), ForwardItem(1, [0, 0, 0], 7, 1)])


# --- no synchronising construct on the way to the device --------------------------------------------------------
class RecordSyncingConstructs(TorchFunctionMode):
    """Records every construct that synchronises the stream on CUDA, whatever device it runs on here (so a CPU
    test sees what ``torch.cuda.set_sync_debug_mode`` would on a GPU): a tensor built from host data for a device
    (``torch.tensor`` / ``as_tensor`` / ``asarray`` with ``device=``: a pageable blocking copy on CUDA), a move
    with ``.to(device)`` / ``.to(tensor)`` / ``.cuda()`` (blocking unless pinned and non-blocking), ``copy_``
    without ``non_blocking=True``, and host reads (``item``, ``tolist``, ``bool`` / ``int`` / ``float``,
    ``nonzero``). ``torch.from_numpy`` and numpy writes are not torch functions: the staging path uses those."""

    _FACTORIES = {torch.tensor, torch.as_tensor, torch.asarray}
    _READS = {torch.Tensor.item, torch.Tensor.tolist, torch.Tensor.__bool__, torch.Tensor.__int__,
              torch.Tensor.__float__, torch.Tensor.__index__, torch.Tensor.nonzero, torch.nonzero}

    def __init__(self):
        super().__init__()
        self.seen: list[str] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__qualname__", None) or getattr(func, "__name__", repr(func))
        if func in self._FACTORIES and kwargs.get("device") is not None:
            self.seen.append(f"{name}(..., device={kwargs['device']})")
        elif func is torch.Tensor.to and ("device" in kwargs or any(
                isinstance(a, (str, torch.device, torch.Tensor)) for a in args[1:])):
            self.seen.append(f"{name}{tuple(a for a in args[1:] if not isinstance(a, torch.Tensor))}")
        elif func is torch.Tensor.cuda or (func is torch.Tensor.copy_ and not kwargs.get("non_blocking")
                                           and not (len(args) > 2 and args[2])):
            self.seen.append(name)
        elif func in self._READS:
            self.seen.append(name)
        return func(*args, **kwargs)


def _lies_in(t: torch.Tensor, buffer: torch.Tensor) -> bool:
    start, end = buffer.data_ptr(), buffer.data_ptr() + buffer.numel() * buffer.element_size()
    return start <= t.data_ptr() and t.data_ptr() + t.numel() * t.element_size() <= end


@pytest.mark.parametrize("separate", [False, True])  # True: the copy a CUDA device makes
def test_tree_masks_ride_in_the_one_staging_copy_with_no_syncing_construct(separate):
    """A batch with a target tree window (square mask), a draft tree level (a mask wider than its new tokens), a
    prefill chunk and a decode: ``prepare`` builds nothing with ``torch.tensor(..., device=...)``, moves nothing
    with ``.to(device)`` and reads nothing back, and the tree mask and its offsets are views of the staging
    buffer, like the rest of the metadata (on the device side: the forward's one copy)."""
    bm, items = tree_mask_batch()
    tree, level = items[0].mask, items[1].mask
    runner = ModelRunner(None, None, bm, torch.device("cpu"))
    runner.staging = StagingBuffer("cpu", separate_device_buffer=separate)
    with RecordSyncingConstructs() as mode:
        meta, ids, positions, logits_indices = runner.prepare(items)
    assert mode.seen == [], f"prepare made constructs that synchronise the stream on CUDA: {mode.seen}"
    staging = runner.staging
    buffer = staging._device_buf if separate else staging._hosts[staging.slot]
    for name, t in [("tree_mask", meta.tree_mask), ("tree_mask_indptr", meta.tree_mask_indptr),
                    ("positions", positions), ("block_tables", meta.block_tables)]:
        assert _lies_in(t, buffer), f"{name} is not a view of the staging buffer"
    assert staging.num_copies == (1 if separate else 0)
    assert meta.tree_mask.dtype == torch.bool and meta.tree_mask.is_contiguous()
    assert meta.tree_mask.tolist() == tree.flatten().tolist() + level.flatten().tolist()
    assert meta.tree_mask_indptr.dtype == torch.int32 and meta.tree_mask_indptr.tolist() == [0, 9, 19, 19, 19]
    expected = reference_metadata(items, bm)
    got = {"input_ids": ids, "positions": positions, "slot_mapping": meta.slot_mapping,
           "logits_indices": logits_indices, "block_tables": meta.block_tables, "seq_lens": meta.seq_lens,
           "cu_q_lens": meta.cu_q_lens, "tree_mask": meta.tree_mask, "tree_mask_indptr": meta.tree_mask_indptr}
    for name, tensor in expected.items():
        assert same_tensor(got[name], tensor), name


def test_a_tree_mask_on_a_device_is_refused_before_anything_is_staged():
    bm = BlockManager(8, 4)
    bm.allocate(0, 6)
    runner = ModelRunner(None, None, bm, torch.device("cpu"))
    slot = runner.staging.slot
    with pytest.raises(ValueError, match="must be a host tensor"):
        runner.prepare([ForwardItem(0, [1, 2], 4, 2, [4, 5], torch.ones(2, 2, dtype=torch.bool, device="meta"))])
    assert runner.staging.slot == slot  # nothing staged
