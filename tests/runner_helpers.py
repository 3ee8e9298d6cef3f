"""Batches shared by the runner tests on CPU (tests/unit/runner/) and their CUDA twins (tests/gpu/):
ModelRunner.prepare's list-built reference and random ragged batches (test_staging.py, test_staging_cuda.py),
and the static forward's uniform batches (test_static_forward.py, test_cuda_graphs.py)."""

from __future__ import annotations

import itertools
import random

import torch

from specdec.cache.block_manager import BlockManager
from specdec.runner.model_runner import ForwardItem

BLOCK_SIZE = 4
NUM_BLOCKS = 40
K = 3  # speculative tokens: verification windows of K + 1


# --- ModelRunner.prepare (test_staging.py) ----------------------------------------------------------------------
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
    tree_mask = tree_mask_indptr = None
    if any(item.mask is not None for item in items):  # the masks concatenated, an empty slice for a causal item
        tree_mask = torch.cat([item.mask.reshape(-1) for item in items if item.mask is not None])
        sizes = [0 if item.mask is None else item.mask.numel() for item in items]
        tree_mask_indptr = torch.tensor([0, *itertools.accumulate(sizes)], dtype=torch.int32)
    return {
        "tree_mask": tree_mask,
        "tree_mask_indptr": tree_mask_indptr,
        "input_ids": torch.tensor(token_ids, dtype=torch.int64),
        "positions": torch.tensor(positions, dtype=torch.int64),
        "slot_mapping": torch.tensor(slots, dtype=torch.int64),
        "logits_indices": torch.tensor(logits_indices, dtype=torch.int64),
        "block_tables": torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32),
        "seq_lens": torch.tensor(seq_lens, dtype=torch.int32),
        "cu_q_lens": torch.tensor(cu_q_lens, dtype=torch.int32),
    }


def same_tensor(got: torch.Tensor | None, expected: torch.Tensor | None) -> bool:
    """Equal dtype and values (both None counts as equal); ``got`` may be on another device."""
    if got is None or expected is None:
        return got is None and expected is None
    return got.dtype == expected.dtype and torch.equal(got.cpu(), expected)


def random_batch(rng: random.Random, bm: BlockManager, seqs: dict[int, int]) -> list[ForwardItem]:
    """Reserve slots for a random ragged batch (prefill chunks, decodes, windows, tree windows) and describe it."""
    items = []
    for seq_id in rng.sample(sorted(seqs), rng.randint(1, len(seqs))):
        computed = seqs[seq_id]
        n = rng.choice([1, 1, 2, 5, rng.randint(1, 40)])
        lookahead = rng.choice([0, 0, 3])
        if bm.seq_len(seq_id) < computed + n + lookahead:
            bm.append_slots(seq_id, computed + n + lookahead - bm.seq_len(seq_id))
        positions = mask = None
        if n > 1 and rng.random() < 0.2:  # a tree window: RoPE positions by depth, a mask over the last w keys
            positions = [computed + rng.randint(0, i) for i in range(n)]
            w = n + rng.choice([0, 0, rng.randint(0, computed)])  # > n: a draft tree level over cached nodes
            mask = torch.rand(n, w, generator=torch.Generator().manual_seed(rng.randrange(1 << 30))) < 0.5
        items.append(ForwardItem(seq_id, [rng.randrange(1000) for _ in range(n)], computed,
                                 rng.randint(0, n), positions, mask))
    return items


def tree_mask_batch() -> tuple[BlockManager, list[ForwardItem]]:
    """A block manager and a batch of a target tree window (square mask, 9 entries), a draft tree level (2 new
    tokens over 5 cached keys, 10 entries), a prefill chunk and a decode (causal: empty mask slices)."""
    bm = BlockManager(64, 4)
    for seq_id, n in enumerate([9, 14, 6, 5]):
        bm.allocate(seq_id, n)
    tree = torch.tensor([[1, 0, 0], [1, 1, 0], [1, 0, 1]], dtype=torch.bool)  # a root and two children
    level = torch.tensor([[1, 0, 1, 0, 1], [0, 1, 0, 1, 1]], dtype=torch.bool)
    return bm, [ForwardItem(0, [1, 2, 3], 6, 3, [6, 7, 7], tree), ForwardItem(1, [4, 5], 12, 2, [9, 9], level),
                ForwardItem(2, [6, 7, 8, 9], 2, 1), ForwardItem(3, [10], 4, 1)]


# --- uniform batches of the static forward (test_static_forward.py) -------------------------------------------
def uniform_batch(seq_lens: list[int], q_len: int, vocab: int, seed: int, width: int | None = None,
                  first_block: int = 1) -> dict:
    """A uniform batch over disjoint blocks ``first_block ..`` (block 0 stays the scratch block); table columns
    past a sequence's end hold out-of-pool ids (they must never be read)."""
    gen = torch.Generator().manual_seed(seed)
    need = [-(-n // BLOCK_SIZE) for n in seq_lens]
    width = width or max(need)
    tables = torch.full((len(seq_lens), width), 10_000, dtype=torch.int32)
    perm = first_block + torch.randperm(NUM_BLOCKS - first_block, generator=gen)
    at = 0
    for b, n in enumerate(need):
        tables[b, :n] = perm[at:at + n].to(torch.int32)
        at += n
    lens = torch.tensor(seq_lens, dtype=torch.int32)
    positions = (lens[:, None].long() - q_len + torch.arange(q_len)).flatten()  # [B*q]
    rows = torch.arange(len(seq_lens)).repeat_interleave(q_len)
    slots = tables[rows, positions // BLOCK_SIZE].long() * BLOCK_SIZE + positions % BLOCK_SIZE
    return {
        "input_ids": torch.randint(0, vocab, (len(seq_lens) * q_len,), generator=gen), "positions": positions,
        "slot_mapping": slots, "block_tables": tables, "seq_lens": lens,
        "cu_q_lens": torch.arange(0, (len(seq_lens) + 1) * q_len, q_len, dtype=torch.int32),
    }  # fmt: skip
