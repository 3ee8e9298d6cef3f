"""The staging buffer's CUDA path (specdec/runner/staging.py): pinned host memory, one non-blocking copy per
forward, and the event that keeps the next forward's host writes from racing the previous copy.

Marked ``gpu``: excluded from the default run; selected without CUDA every test FAILS ("needs CUDA"). The CPU
side (layout, growth, the separate-buffer copy path, prepare == the list-built metadata) is
tests/test_staging.py.
"""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch
from test_staging import _random_batch, reference_metadata

from specdec.cache.block_manager import BlockManager
from specdec.runner.model_runner import ModelRunner
from specdec.runner.staging import StagingBuffer

pytestmark = pytest.mark.gpu


@pytest.fixture(autouse=True)
def _needs_cuda():
    if not torch.cuda.is_available():
        pytest.fail("needs CUDA: tests/gpu checks the staging buffer's pinned copy on a GPU")


def test_the_host_buffer_is_pinned_and_one_copy_lands_every_section():
    buf = StagingBuffer("cuda", initial_bytes=64)
    assert buf._host.is_pinned()
    a, b = buf.stage([(5, np.int64), (3, np.int32)])
    a[:] = np.arange(5)
    b[:] = [7, 8, 9]
    ta, tb = buf.to_device()
    assert ta.is_cuda and tb.is_cuda and buf.num_copies == 1
    assert ta.tolist() == [0, 1, 2, 3, 4] and tb.tolist() == [7, 8, 9]


def test_the_next_stage_waits_for_the_previous_copy():
    buf = StagingBuffer("cuda", initial_bytes=1 << 20)
    n = 1 << 16
    (a,) = buf.stage([(n, np.int64)])
    a[:] = 1
    torch.cuda._sleep(50_000_000)  # keep the stream busy: the copy below is queued behind ~tens of ms of work
    (first,) = buf.to_device()
    kept = first.clone()  # stream-ordered after the copy
    (b,) = buf.stage([(n, np.int64)])  # must wait for the copy to land before the host memory is handed out
    b[:] = 2
    (second,) = buf.to_device()
    assert kept.eq(1).all() and second.eq(2).all()


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
        items = _random_batch(rng, bm, seqs)
        expected = reference_metadata(items, bm)
        meta, ids, positions, logits_indices = runner.prepare(items)
        got = {"input_ids": ids, "positions": positions, "slot_mapping": meta.slot_mapping,
               "logits_indices": logits_indices, "block_tables": meta.block_tables, "seq_lens": meta.seq_lens,
               "cu_q_lens": meta.cu_q_lens}
        for name, tensor in expected.items():
            assert got[name].is_cuda and torch.equal(got[name].cpu(), tensor), name
        for item in items:
            seqs[item.seq_id] = item.start_pos + rng.randint(0, len(item.token_ids))
            bm.truncate_to(item.seq_id, max(seqs[item.seq_id], bm.seq_len(item.seq_id) - rng.randint(0, 9)))
