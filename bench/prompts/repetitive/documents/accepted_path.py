"""A tree round's accepted path made contiguous in the target's KV cache (the proposer moves its own:
``Proposer.move_accepted_path``).

A tree's node i was written at logical position ``ctx + i`` (DFS order, ``specdec.spec_decode.tree``). After
verification the accepted path - nodes ``accepted_nodes[0], accepted_nodes[1], ...`` at depths 1, 2, ... - must
sit at ``ctx + 1, ctx + 2, ...``, right after the root, as if it had been a chain. ``accepted_path_moves`` lists the
flat cache slots of those moves for one request; :func:`move_accepted_path` copies them with ``KVPool.compact``
(``ops.kv_compact``, which reads every source before writing any destination). The request's KV is then cut to
``ctx + 1 + len(accepted_nodes)`` by the round's rollback (``Speculator.finish_round``), in the same call.
"""

from __future__ import annotations

import torch

from specdec.cache.block_manager import BlockManager
from specdec.cache.kv_pool import KVPool
from specdec.device import to_device


def move_accepted_path(pool: KVPool, block_manager: BlockManager, seq_id: int, root: int,
                       accepted_nodes: list[int]) -> None:
    """Move request ``seq_id``'s accepted path (node i was written at ``root + i``; ``root``: the root's position,
    the request's committed length before the round) to ``root + 1, root + 2, ..``: one ``KVPool.compact``."""
    src, dst = accepted_path_moves(block_manager, seq_id, root, accepted_nodes)
    if src:
        device = pool.tensors[0].device
        pool.compact(to_device(src, torch.int64, device), to_device(dst, torch.int64, device))


def accepted_path_moves(
    block_manager: BlockManager, seq_id: int, ctx: int, accepted_nodes: list[int]
) -> tuple[list[int], list[int]]:
    """``(src, dst)`` flat slots of the moves that make a tree's accepted path contiguous.

    Args:
        block_manager: owns ``seq_id``'s block table; only read (``slot``, ``seq_len``).
        seq_id: the request.
        ctx: logical position of the tree's root (node 0), i.e. tokens in the cache before the tree.
        accepted_nodes: the accepted drafts in path order, excluding the root: ``accepted_nodes[j - 1]`` is the
            accepted node at depth j. Strictly increasing node indices >= 1 (a path in DFS order), each at a
            position the sequence has reserved (``ctx + node < seq_len``).
    Returns:
        Two equal-length lists of ints: node ``accepted_nodes[j - 1]`` moves from slot ``slot(ctx + node)`` to
        ``slot(ctx + j)``; moves that stay in place (the path's prefix that is already contiguous) are left out.
        Every destination is at a position <= its source's, and destinations are distinct.
    """
    if not block_manager.has_seq(seq_id):
        raise ValueError(f"sequence {seq_id} has no blocks")
    seq_len = block_manager.seq_len(seq_id)
    if not 0 <= ctx < seq_len:
        raise ValueError(f"ctx (the root's position) must lie in [0, seq_len = {seq_len}), got {ctx}")
    previous = 0
    for node in accepted_nodes:
        if not isinstance(node, int) or node <= previous:
            raise ValueError(f"accepted_nodes must be strictly increasing node indices >= 1 (the root, node 0, "
                             f"never moves), got {accepted_nodes}")  # fmt: skip
        previous = node
    if accepted_nodes and ctx + accepted_nodes[-1] >= seq_len:
        raise ValueError(f"accepted node {accepted_nodes[-1]} at position {ctx + accepted_nodes[-1]} is beyond "
                         f"the sequence's {seq_len} reserved slots")  # fmt: skip
    src, dst = [], []
    for depth, node in enumerate(accepted_nodes, start=1):
        if node != depth:
            src.append(block_manager.slot(seq_id, ctx + node))
            dst.append(block_manager.slot(seq_id, ctx + depth))
    return src, dst
