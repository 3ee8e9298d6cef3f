"""Block manager: unit cases and a hypothesis property test (no leak, no double ownership)."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from specdec.cache.block_manager import BlockManager


def test_truncate_to_frees_blocks_wholly_beyond_the_new_length():
    bm = BlockManager(10, 4)
    bm.allocate(0, 9)  # 3 blocks
    assert bm.num_free_blocks == 7
    bm.truncate_to(0, 8)  # exactly 2 blocks
    assert len(bm.block_table(0)) == 2 and bm.num_free_blocks == 8
    bm.truncate_to(0, 5)  # still 2 blocks (the partial one is kept)
    assert len(bm.block_table(0)) == 2
    bm.append_slots(0, 4)  # 9 -> 3 blocks
    assert len(bm.block_table(0)) == 3
    bm.truncate_to(0, 0)
    assert bm.block_table(0) == [] and bm.num_free_blocks == 10
    bm.free(0)
    bm.check_invariants()


def test_slot_follows_the_block_table():
    bm = BlockManager(8, 4)
    bm.allocate(1, 2)
    bm.allocate(2, 6)
    table = bm.block_table(2)
    assert bm.slot(2, 5) == table[1] * 4 + 1


def test_allocation_beyond_the_pool_raises_and_changes_nothing():
    bm = BlockManager(2, 4)
    bm.allocate(0, 5)
    with pytest.raises(MemoryError):
        bm.allocate(1, 1)
    with pytest.raises(MemoryError):
        bm.append_slots(0, 4)
    assert bm.seq_len(0) == 5 and bm.num_free_blocks == 0
    bm.check_invariants()


ops = st.lists(st.tuples(st.sampled_from(["alloc", "append", "truncate", "free"]), st.integers(0, 4),
                         st.integers(0, 40)), max_size=80)


@settings(max_examples=200, deadline=None)
@given(ops=ops, block_size=st.integers(1, 8))
def test_random_operations_never_leak_or_double_own(ops, block_size):
    bm = BlockManager(24, block_size)
    lengths: dict[int, int] = {}
    for op, seq, n in ops:
        if op == "alloc" and seq not in lengths:
            if bm.can_allocate(n):
                bm.allocate(seq, n)
                lengths[seq] = n
        elif op == "append" and seq in lengths:
            if bm.can_append(seq, n):
                bm.append_slots(seq, n)
                lengths[seq] += n
        elif op == "truncate" and seq in lengths:
            new_len = min(n, lengths[seq])
            bm.truncate_to(seq, new_len)
            lengths[seq] = new_len
        elif op == "free":
            bm.free(seq)
            lengths.pop(seq, None)
        bm.check_invariants()
        for s, length in lengths.items():
            assert bm.seq_len(s) == length
            assert len(bm.block_table(s)) == -(-length // block_size)
    for s in list(lengths):
        bm.free(s)
    assert bm.num_free_blocks == 24
