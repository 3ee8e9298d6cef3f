"""ModelRunner: turns a ragged batch of (sequence, new tokens) into one forward of a model on its paged pool."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from specdec.cache.block_manager import BlockManager
from specdec.cache.kv_pool import KVPool
from specdec.model.llama import AttentionMetadata, LlamaForCausalLM


@dataclass
class ForwardItem:
    """One sequence's slice of a ragged forward."""

    seq_id: int
    token_ids: list[int]  # the new tokens (their K/V get written)
    start_pos: int  # absolute position of token_ids[0]
    num_logits: int  # logits wanted for the last ``num_logits`` new tokens (0 = none)
    # Tree windows (specdec/drafters/tree.py). ``positions``: the RoPE position of each new token (None:
    # start_pos + i, the KV slot order). ``mask``: bool [len(token_ids), w], which of the last w key positions
    # (the new tokens are the last len(token_ids) of them) token i attends; the keys before those w are context,
    # seen by every token. None = causal.
    positions: list[int] | None = None
    mask: torch.Tensor | None = None


class ModelRunner:
    def __init__(self, model: LlamaForCausalLM, pool: KVPool, block_manager: BlockManager, device: torch.device):
        self.model = model
        self.pool = pool
        self.block_manager = block_manager
        self.device = device
        self.num_forwards = 0

    def forward(self, items: list[ForwardItem], input_ids: torch.Tensor | None = None) -> torch.Tensor:
        """Run one forward over ``items``; fp32 logits ``[sum(num_logits), V]`` in item order.

        The block manager must already hold slots for every new token (``start_pos + len(token_ids)``).
        ``input_ids``: int64 ``[sum(len(token_ids))]`` on the device, the new tokens themselves when they are
        already there (a draft step's previous drafts); the items' ``token_ids`` then only give the counts.
        """
        bm = self.block_manager
        token_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        logits_indices: list[int] = []
        cu_q_lens = [0]
        seq_lens: list[int] = []
        tables: list[list[int]] = []
        masks: list[torch.Tensor | None] = []
        for item in items:
            n = len(item.token_ids)
            assert bm.seq_len(item.seq_id) >= item.start_pos + n, "slots not reserved before the forward"
            token_ids += item.token_ids
            if item.positions is None:
                positions += range(item.start_pos, item.start_pos + n)
            else:
                positions += item.positions
            masks.append(item.mask)
            slots += [bm.slot(item.seq_id, p) for p in range(item.start_pos, item.start_pos + n)]
            logits_indices += range(cu_q_lens[-1] + n - item.num_logits, cu_q_lens[-1] + n)
            cu_q_lens.append(cu_q_lens[-1] + n)
            seq_lens.append(item.start_pos + n)
            tables.append(bm.block_table(item.seq_id))
        max_blocks = max(len(t) for t in tables)
        block_tables = torch.tensor([t + [0] * (max_blocks - len(t)) for t in tables], dtype=torch.int32)
        dev = self.device
        tree_mask, tree_mask_indptr = _pack_masks(masks, dev)
        meta = AttentionMetadata(
            slot_mapping=torch.tensor(slots, dtype=torch.int64, device=dev),
            block_tables=block_tables.to(dev),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=dev),
            cu_q_lens=torch.tensor(cu_q_lens, dtype=torch.int32, device=dev),
            tree_mask=tree_mask,
            tree_mask_indptr=tree_mask_indptr,
        )
        self.num_forwards += 1
        if input_ids is None:
            ids = torch.tensor(token_ids, dtype=torch.int64, device=dev)
        else:
            assert input_ids.shape == (len(token_ids),), "input_ids must hold one id per new token"
            ids = input_ids
        return self.model(
            ids,
            torch.tensor(positions, dtype=torch.int64, device=dev),
            self.pool.tensors,
            meta,
            torch.tensor(logits_indices, dtype=torch.int64, device=dev),
        )


def _pack_masks(masks: list[torch.Tensor | None], device: torch.device
                ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """The paged-attention kernel's packed tree masks: bool ``[sum(q_len_b * w_b)]`` and int32 indptr ``[B+1]``,
    or ``(None, None)`` when no item has a mask. An item without a mask gets an empty slice (causal)."""
    if all(m is None for m in masks):
        return None, None
    flat = [m.reshape(-1) for m in masks if m is not None]
    indptr = [0]
    for m in masks:
        indptr.append(indptr[-1] + (m.numel() if m is not None else 0))
    return (torch.cat(flat).to(device),
            torch.tensor(indptr, dtype=torch.int32, device=device))
