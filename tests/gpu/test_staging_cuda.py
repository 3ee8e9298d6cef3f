"""The staging buffer's CUDA path (specdec/runner/staging.py): pinned host slots, one non-blocking copy per
forward, and the per-slot events that keep a stage's host writes from racing the copy made from the same slot
``num_slots`` forwards ago - and only that one (the previous forward's copy may still be queued).

Marked ``gpu``: excluded from the default run; selected without CUDA every test FAILS ("needs CUDA"). The CPU
side (layout, growth, the separate-buffer copy path, prepare == the list-built metadata) is
tests/unit/runner/test_staging.py.
"""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch
from runner_helpers import random_batch, reference_metadata, same_tensor, tree_mask_batch

from specdec.cache.block_manager import BlockManager
from specdec.runner.model_runner import ModelRunner
from specdec.runner.staging import StagingBuffer

pytestmark = pytest.mark.gpu


def test_the_host_slots_are_pinned_and_one_copy_lands_every_section():
    buf = StagingBuffer("cuda", initial_bytes=64)
    assert buf.num_slots == 2 and all(h.is_pinned() for h in buf._hosts)
    a, b, m = buf.stage([(5, np.int64), (3, np.int32), (4, np.bool_)])
    a[:] = np.arange(5)
    b[:] = [7, 8, 9]
    m[:] = [True, False, False, True]
    ta, tb, tm = buf.to_device()
    assert ta.is_cuda and tb.is_cuda and tm.is_cuda and tm.dtype == torch.bool and buf.num_copies == 1
    assert ta.tolist() == [0, 1, 2, 3, 4] and tb.tolist() == [7, 8, 9] and tm.tolist() == [True, False, False, True]


def test_a_stage_waits_for_its_own_slots_copy_not_the_previous_one():
    buf = StagingBuffer("cuda", initial_bytes=1 << 20)
    n = 1 << 16
    (a,) = buf.stage([(n, np.int64)])  # slot 0
    a[:] = 1
    torch.cuda._sleep(50_000_000)  # keep the stream busy: the copies below are queued behind ~tens of ms of work
    (first,) = buf.to_device()
    kept = first.clone()  # stream-ordered after the copy
    (b,) = buf.stage([(n, np.int64)])  # slot 1: no wait for copy 1, still queued behind the sleep
    assert buf.num_waits == 0 and not buf._events[0].query(), "staging the next forward waited for the last copy"
    b[:] = 2
    (second,) = buf.to_device()
    kept2 = second.clone()
    (c,) = buf.stage([(n, np.int64)])  # slot 0 again: must wait for copy 1 before its memory is handed out
    assert buf._events[0].query() and buf.num_waits == 1
    c[:] = 3
    (third,) = buf.to_device()
    assert kept.eq(1).all() and kept2.eq(2).all() and third.eq(3).all()


@pytest.mark.parametrize("block_size", [1, 16])
def test_prepare_on_cuda_equals_the_list_built_metadata(block_size):
    rng = random.Random(block_size)
    bm = BlockManager(4096, block_size)
    runner = ModelRunner(None, None, bm, torch.device("cuda"))
    seqs: dict[int, int] = {}
    for seq_id in range(12):
        bm.allocate(seq_id, rng.randint(1, 30))
        seqs[seq_id] = 0
    for _ in range(20):
        items = random_batch(rng, bm, seqs)
        expected = reference_metadata(items, bm)
        meta, ids, positions, logits_indices = runner.prepare(items)
        got = {"input_ids": ids, "positions": positions, "slot_mapping": meta.slot_mapping,
               "logits_indices": logits_indices, "block_tables": meta.block_tables, "seq_lens": meta.seq_lens,
               "cu_q_lens": meta.cu_q_lens, "tree_mask": meta.tree_mask, "tree_mask_indptr": meta.tree_mask_indptr}
        for name, tensor in expected.items():
            assert got[name] is None or got[name].is_cuda, name
            assert same_tensor(got[name], tensor), name
        for item in items:
            seqs[item.seq_id] = item.start_pos + rng.randint(0, len(item.token_ids))
            bm.truncate_to(item.seq_id, max(seqs[item.seq_id], bm.seq_len(item.seq_id) - rng.randint(0, 9)))


def test_prepare_with_tree_masks_does_not_synchronise():
    """The tree masks ride in the forward's one pinned, non-blocking copy: ``prepare`` passes under
    ``torch.cuda.set_sync_debug_mode("error")`` (the masks' own pageable ``.to`` and ``torch.tensor(indptr,
    device=...)`` raised there)."""
    bm, items = tree_mask_batch()
    runner = ModelRunner(None, None, bm, torch.device("cuda"))
    expected = reference_metadata(items, bm)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in range(3):  # both slots, then the first one again
            meta, *_ = runner.prepare(items)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert meta.tree_mask.is_cuda and same_tensor(meta.tree_mask, expected["tree_mask"])
    assert same_tensor(meta.tree_mask_indptr, expected["tree_mask_indptr"])
