"""Persistent step state: the staging buffer, the block manager's incremental ``table_array`` / ``read_only``, and
``ModelRunner.prepare`` against a reference that builds the metadata from Python lists the way the runner did
before (one ``torch.tensor`` per array, ``bm.slot`` per token)."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

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
def reference_metadata(items: list[ForwardItem], bm: BlockManager) -> dict[str, torch.Tensor]:
    """The metadata as ModelRunner built it before the staging buffer: Python lists, ``bm.slot`` per token."""
    token_ids, positions, slots, logits_indices, cu_q_lens, seq_lens, tables = [], [], [], [], [0], [], []
    for item in items:
        n = len(item.token_ids)
        token_ids += item.token_ids
        positions += range(item.start_pos, item.start_pos + n) if item.positions is None else item.positions
        slots += [bm.slot(item.seq_id, p) for p in range(item.start_pos, item.start_pos + n)]
        logits_indices += range(cu_q_lens[-1] + n - item.num_logits, cu_q_lens[-1] + n)
        cu_q_lens.append(cu_q_lens[-1] + n)
        seq_lens.append(item.start_pos + n)
        tables.append(bm.block_table(item.seq_id))
    width = max(len(t) for t in tables)
    return {
        "input_ids": torch.tensor(token_ids, dtype=torch.int64),
        "positions": torch.tensor(positions, dtype=torch.int64),
        "slot_mapping": torch.tensor(slots, dtype=torch.int64),
        "logits_indices": torch.tensor(logits_indices, dtype=torch.int64),
        "block_tables": torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32),
        "seq_lens": torch.tensor(seq_lens, dtype=torch.int32),
        "cu_q_lens": torch.tensor(cu_q_lens, dtype=torch.int32),
    }


def _prepared(runner: ModelRunner, items: list[ForwardItem]) -> dict[str, torch.Tensor]:
    meta, ids, positions, logits_indices = runner.prepare(items)
    assert meta.tree_mask is None if all(it.mask is None for it in items) else meta.tree_mask is not None
    return {"input_ids": ids, "positions": positions, "slot_mapping": meta.slot_mapping,
            "logits_indices": logits_indices, "block_tables": meta.block_tables, "seq_lens": meta.seq_lens,
            "cu_q_lens": meta.cu_q_lens}


def _random_batch(rng: random.Random, bm: BlockManager, seqs: dict[int, int]) -> list[ForwardItem]:
    """Reserve slots for a random ragged batch (prefill chunks, decodes, windows, tree windows) and describe it."""
    items = []
    for seq_id in rng.sample(sorted(seqs), rng.randint(1, len(seqs))):
        computed = seqs[seq_id]
        n = rng.choice([1, 1, 2, 5, rng.randint(1, 40)])
        lookahead = rng.choice([0, 0, 3])
        if bm.seq_len(seq_id) < computed + n + lookahead:
            bm.append_slots(seq_id, computed + n + lookahead - bm.seq_len(seq_id))
        positions = mask = None
        if n > 1 and rng.random() < 0.2:  # a tree window: RoPE positions by depth, a mask over the window
            positions = [computed + rng.randint(0, i) for i in range(n)]
            mask = torch.rand(n, n) < 0.5
        items.append(ForwardItem(seq_id, [rng.randrange(1000) for _ in range(n)], computed,
                                 rng.randint(0, n), positions, mask))
    return items


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
        items = _random_batch(rng, bm, seqs)
        expected = reference_metadata(items, bm)
        got = _prepared(runner, items)
        for name, tensor in expected.items():
            assert got[name].dtype == tensor.dtype and torch.equal(got[name], tensor), name
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
