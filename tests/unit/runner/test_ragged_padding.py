"""Ragged causal windows padded to one captured q_len (``ModelRunner.padded_q_len`` / ``prepare(pad_to=)``).

A model-free drafter's verification windows differ in length per request; padded, the batch is uniform and a
static forward serves it (mode "eager" here: the same buckets and scratch block a CUDA graph replays). The real
tokens' logits and K/V equal the unpadded eager forward's; the padding writes only the scratch block; trees, a
prefill chunk longer than every captured q_len, a draft step's device ids and the CPU default are not padded.
"""

from __future__ import annotations

import pytest
import torch
from tiny_models import make_tiny_model

from specdec.cache.block_manager import BlockManager
from specdec.cache.kv_pool import KVPool
from specdec.checkpoint.loader import load_model
from specdec.model.config import ModelConfig
from specdec.runner.model_runner import ForwardItem, ModelRunner

BLOCK_SIZE, NUM_BLOCKS, K = 4, 48, 4


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("ragged_tiny"))
    make_tiny_model(path, "llama", seed=11, num_heads=4, num_kv_heads=2)
    config = ModelConfig.from_json(path)
    return load_model(path, torch.float32, torch.device("cpu"), 256, config, prepack_weights=False), config


def runner_with_context(model, config, contexts, static: bool, seed=0):
    """A runner whose sequences hold ``contexts[i]`` tokens of random K/V (the same for every call with ``seed``),
    with K + 1 more slots reserved each (a verification window's lookahead)."""
    bm = BlockManager(NUM_BLOCKS, BLOCK_SIZE)
    pool = KVPool(config, NUM_BLOCKS, BLOCK_SIZE, torch.float32, "cpu")
    gen = torch.Generator().manual_seed(seed)
    pool.k.copy_(torch.randn(pool.k.shape, generator=gen))
    pool.v.copy_(torch.randn(pool.v.shape, generator=gen))
    runner = ModelRunner(model, pool, bm, torch.device("cpu"))
    if static:
        runner.enable_static_forward("eager", tuple(range(1, K + 2)), max_seq_len=64, max_batch=8)
    else:  # the same block taken as the static runner's scratch block, so both lay sequences out alike
        from specdec.runner.cuda_graphs import reserve_scratch_block

        reserve_scratch_block(bm)
    for seq_id, context in enumerate(contexts):
        bm.allocate(seq_id, context + K + 1)
    return runner, bm, pool


def windows(lengths, contexts, vocab, seed=1):
    gen = torch.Generator().manual_seed(seed)
    return [ForwardItem(i, torch.randint(0, vocab, (n,), generator=gen).tolist(), contexts[i], n)
            for i, n in enumerate(lengths)]


@pytest.mark.parametrize("lengths", [[1, 5, 3], [2, 1, 1, 1, 1], [5, 4]])
def test_ragged_windows_through_the_static_path_equal_the_eager_forward(tiny, lengths):
    model, config = tiny
    contexts = [7, 13, 2, 9, 4][: len(lengths)]
    eager, bm_e, pool_e = runner_with_context(model, config, contexts, static=False)
    static, bm_s, pool_s = runner_with_context(model, config, contexts, static=True)
    assert bm_e.table_array.tolist() == bm_s.table_array.tolist()
    items = windows(lengths, contexts, config.vocab_size)
    before = pool_s.k.clone()
    assert static.padded_q_len(items) == max(lengths)
    expected = eager.forward(items)
    got = static.forward(items)
    assert static.static.num_replays == 1 and static.static.num_fallbacks == 0  # served by a bucket, not eagerly
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
    assert torch.equal(got.argmax(-1), expected.argmax(-1))
    # the real tokens' K/V are the eager forward's; the padding wrote the scratch block and nothing else
    scratch = static.scratch_block
    real = [bm_s.block_table(i)[p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE
            for i, item in enumerate(items) for p in range(item.start_pos, item.start_pos + len(item.token_ids))]
    flat = lambda t: t.view(t.shape[0], -1, t.shape[-2], t.shape[-1])  # noqa: E731 - (L, slots, Hkv, D)
    torch.testing.assert_close(flat(pool_s.k)[:, real], flat(pool_e.k)[:, real], atol=1e-5, rtol=1e-5)
    others = [b for b in range(NUM_BLOCKS) if b != scratch]
    changed = (pool_s.k != before).flatten(2).any(-1)  # (L, num_blocks): blocks with a written slot
    written = {b for b in others if bool(changed[:, b].any())}
    assert written == {slot // BLOCK_SIZE for slot in real}
    if min(lengths) < max(lengths):
        assert bool(changed[:, scratch].any())


def test_what_is_not_padded(tiny):
    model, config = tiny
    contexts = [7, 13, 2]
    static, bm, _ = runner_with_context(model, config, contexts, static=True)
    items = windows([1, 5, 3], contexts, config.vocab_size)
    assert static.padded_q_len(items) == K + 1
    assert static.padded_q_len(windows([3, 3, 3], contexts, config.vocab_size)) is None  # uniform: served as is
    assert static.padded_q_len(items[:1]) is None
    tree = ForwardItem(2, [1, 2, 3], contexts[2], 3, mask=torch.ones(3, 3, dtype=torch.bool))
    assert static.padded_q_len([items[0], tree]) is None
    bm.allocate(3, 30)
    prefill = ForwardItem(3, list(range(20)), 0, 1)  # longer than every captured q_len
    assert static.padded_q_len([items[0], prefill]) is None
    eager, _, _ = runner_with_context(model, config, contexts, static=False)
    assert eager.padded_q_len(items) is None  # the CPU default: no static forward, nothing padded


def test_prepare_pads_each_window_after_its_real_tokens(tiny):
    model, config = tiny
    contexts = [7, 13]
    static, bm, _ = runner_with_context(model, config, contexts, static=True)
    items = windows([1, 3], contexts, config.vocab_size)
    meta, ids, positions, logits = static.prepare(items, pad_to=4)
    scratch = static.scratch_block * BLOCK_SIZE
    assert positions.tolist() == [7, 7, 7, 7, 13, 14, 15, 15]  # the padding repeats the window's last position
    assert ids.tolist()[1:4] == [0, 0, 0] and ids.tolist()[7] == 0
    assert ids.tolist()[0] == items[0].token_ids[0] and ids.tolist()[4:7] == items[1].token_ids
    assert meta.seq_lens.tolist() == [11, 17] and meta.cu_q_lens.tolist() == [0, 4, 8]
    assert logits.tolist() == [0, 4, 5, 6]  # the real tokens' rows only
    slots = meta.slot_mapping.tolist()
    assert slots[1:4] == [scratch, scratch + 1, scratch + 2] and slots[7] == scratch
    assert slots[0] == bm.block_table(0)[1] * BLOCK_SIZE + 3


def test_no_padding_where_no_bucket_serves_and_padding_stays_in_the_rope_table(tiny):
    """More sequences than the largest bucket: not padded (run eagerly as they are). Padding takes the window's last
    RoPE position, never one past it (a window near max_model_len would read past the rope table)."""
    model, config = tiny
    contexts = [7, 13, 2]
    static, bm, _ = runner_with_context(model, config, contexts, static=True)
    static.static.batch_sizes = (1, 2)  # the largest bucket takes 2 sequences
    assert static.padded_q_len(windows([1, 5, 3], contexts, config.vocab_size)) is None
    near_end = [55, 2]  # a window at the end of the static forward's 64 positions
    runner, bm2, _ = runner_with_context(model, config, near_end, static=True)
    items = windows([5, 1], near_end, config.vocab_size)
    assert runner.padded_q_len(items) == 5
    _, _, positions, _ = runner.prepare(items, pad_to=5)
    assert positions.tolist() == [55, 56, 57, 58, 59, 2, 2, 2, 2, 2]  # padding never beyond a real position
    assert runner.forward(items).shape == (6, config.vocab_size)
