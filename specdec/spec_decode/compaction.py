"""After a tree round: the accepted paths' K/V made contiguous in the target's cache (the draft model compacts its
own, ``DraftModelProposer.compact``)."""

from __future__ import annotations

import torch

from specdec.cache.block_manager import BlockManager
from specdec.cache.kv_compaction import compaction_slots
from specdec.cache.kv_pool import KVPool
from specdec.device import to_device


def compact_target(pool: KVPool, block_manager: BlockManager, seq_ids: list[int], roots: list[int],
                   accepted_nodes: list[list[int]]) -> None:
    """Move every request's accepted path (node i was written at ``ctx + i``, ``ctx = roots[b]``: the root's
    position, the request's committed length) to ``ctx + 1, ctx + 2, ..`` with one ``KVPool.compact`` for the
    whole batch. Only positions
    beyond each request's committed KV are written (garbage until the commit), so a step that fails after this
    changed nothing a later step reads."""
    src, dst = [], []
    for seq_id, ctx, nodes in zip(seq_ids, roots, accepted_nodes):
        s, d = compaction_slots(block_manager, seq_id, ctx, nodes)
        src += s
        dst += d
    if src:
        device = pool.tensors[0].device
        pool.compact(to_device(src, torch.int64, device), to_device(dst, torch.int64, device))
