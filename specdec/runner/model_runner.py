"""ModelRunner: turns a ragged batch of (sequence, new tokens) into one forward of a model on its paged pool."""

from __future__ import annotations

import logging
from dataclasses import dataclass

import numpy as np
import torch

from specdec.cache.block_manager import BlockManager
from specdec.cache.kv_pool import KVPool
from specdec.model.llama import AttentionMetadata, LlamaForCausalLM
from specdec.runner.cuda_graphs import DEFAULT_BATCH_BUCKETS, StaticForwardRunner, reserve_scratch_block, uniform_q_len
from specdec.runner.staging import StagingBuffer

logger = logging.getLogger(__name__)


@dataclass
class ForwardItem:
    """One sequence's slice of a ragged forward."""

    seq_id: int
    token_ids: list[int]  # the new tokens (their K/V get written)
    start_pos: int  # absolute position of token_ids[0]
    num_logits: int  # logits wanted for the last ``num_logits`` new tokens (0 = none)
    # Tree windows (specdec/spec_decode/tree.py). ``positions``: the RoPE position of each new token (None:
    # start_pos + i, the KV slot order). ``mask``: bool [len(token_ids), w], which of the last w key positions
    # (the new tokens are the last len(token_ids) of them) token i attends; the keys before those w are context,
    # seen by every token. None = causal. A host tensor (or numpy array): it is staged with the other metadata.
    positions: list[int] | None = None
    mask: torch.Tensor | None = None


class ModelRunner:
    """Runs ragged forwards of ``model`` on its paged ``pool``; the block tables come from ``block_manager``.

    The metadata of a forward, tree masks included, is built in a persistent :class:`StagingBuffer` (one
    host-to-device copy per forward on CUDA, none on CPU): the slots and block tables are gathered from the block
    manager's persistent ``table_array`` with numpy, not per token in Python (docs/architecture.md, "Model
    runner"). Nothing on the forward path synchronises the stream on CUDA.
    """

    def __init__(self, model: LlamaForCausalLM, pool: KVPool, block_manager: BlockManager, device: torch.device):
        self.model = model
        self.pool = pool
        self.block_manager = block_manager
        self.device = device
        self.staging = StagingBuffer(device)
        self.num_forwards = 0
        self.static: StaticForwardRunner | None = None  # uniform batches' static forwards (enable_static_forward)
        self.scratch_block: int | None = None  # the padding rows' block, taken from the pool once

    def enable_static_forward(self, mode: str, q_lens: tuple[int, ...], max_seq_len: int, max_batch: int,
                              block_buckets: tuple[int, ...] | None = None) -> None:
        """Serve uniform batches (every item ``q_len in q_lens`` new causal tokens: decodes, draft steps, chain
        windows) through a :class:`StaticForwardRunner` in ``mode`` ("cuda_graph", "compile" or "eager"), captured
        lazily per bucket; everything else stays eager. Takes one block of the pool for padding rows (the engine
        sizes the pool with one to spare). ``max_seq_len``: the longest sequence a forward sees, lookahead
        included; ``max_batch``: the most sequences in one forward (batch buckets: powers of two below it, and it);
        ``block_buckets``: block-table widths (those below the widest, and the widest; None: the widest only).
        """
        if mode == "compile" and any(getattr(m, "weight_released", False) for m in self.model.modules()):
            raise ValueError("the static forward in mode 'compile' needs plain linear weights, and this model's were "
                             "released for their prepacked copies; load it with prepack_weights=False")
        if mode == "compile" and any(getattr(m, "batch_invariant", False) for m in self.model.modules()):
            raise ValueError("the static forward in mode 'compile' traces torch's linears and attention, not the "
                             "batch-invariant CPU kernels: load the model with batch_invariant=False to compile it")
        bm = self.block_manager
        # a second call replaces the runner and keeps the scratch block (the engine makes the first one on CUDA)
        if self.scratch_block is None:
            self.scratch_block = reserve_scratch_block(bm)
        scratch = self.scratch_block
        buckets = tuple(b for b in DEFAULT_BATCH_BUCKETS if b < max_batch) + (max_batch,)
        max_blocks = bm.blocks_needed(max_seq_len)
        widths = None if block_buckets is None else tuple(b for b in block_buckets if b < max_blocks) + (max_blocks,)
        self.static = StaticForwardRunner(self.model, self.pool.tensors, block_size=bm.block_size,
                                          max_blocks=max_blocks, scratch_block=scratch, q_lens=q_lens,
                                          batch_sizes=buckets, block_buckets=widths, mode=mode)

    def forward(self, items: list[ForwardItem], input_ids: torch.Tensor | None = None) -> torch.Tensor:
        """Run one forward over ``items``; fp32 logits ``[sum(num_logits), V]`` in item order.

        The block manager must already hold slots for every new token (``start_pos + len(token_ids)``).
        ``input_ids``: int64 ``[sum(len(token_ids))]`` on the device, the new tokens themselves when they are
        already there (a draft step's previous drafts); the items' ``token_ids`` then only give the counts.
        """
        pad_to = self.padded_q_len(items) if input_ids is None else None
        meta, ids, positions, logits_indices = self.prepare(items, with_ids=input_ids is None, pad_to=pad_to)
        if input_ids is not None:
            assert input_ids.shape == positions.shape, "input_ids must hold one id per new token"
            ids = input_ids
        self.num_forwards += 1
        q_len = pad_to or (uniform_q_len(items) if self.static is not None else None)
        if q_len is not None:
            out = self._static_forward(ids, positions, meta, q_len, logits_indices)
            if out is not None:
                return out
        return self.model(ids, positions, self.pool.tensors, meta, logits_indices)

    def padded_q_len(self, items: list[ForwardItem]) -> int | None:
        """The ``q_len`` a ragged batch of causal windows is padded to so that a static forward serves it, or None.

        A model-free drafter proposes a different number of tokens per request (none where it finds no match), so
        its verification windows are ragged; unpadded, each such forward ran eagerly (an H200 run at batch 8: 56-97%
        of them, several ms each against ~1.5 ms replayed; bench/results/gpu_h200_20261128_real/). Padded, every
        window has the smallest captured ``q_len`` >= the longest: the padding tokens come after each window's real
        tokens (so causal attention keeps them out of the real tokens' results), write their K/V into the scratch
        block, and their logits are not computed. Only with static forwards on (the CPU default path is unchanged),
        only causal windows (no tree masks or explicit positions), and only where every padded table fits the block
        manager's table width and a bucket serves the padded batch."""
        static = self.static
        if static is None or len(items) < 2:
            return None
        lengths = [len(item.token_ids) for item in items]
        longest = max(lengths)
        if min(lengths) == longest or min(lengths) == 0:
            return None  # uniform already, or an empty item
        if any(item.mask is not None or item.positions is not None for item in items):
            return None
        q_len = next((q for q in sorted(static.q_lens) if q >= longest), None)
        if q_len is None:
            return None
        bm = self.block_manager
        width = max(max(len(bm.block_table(item.seq_id)), bm.blocks_needed(item.start_pos + q_len)) for item in items)
        if width > bm.table_array.shape[1] or static.bucket(len(items), q_len, width) is None:
            return None  # the padded tables would not fit, or no bucket serves the batch: eager, unpadded
        return q_len

    def forward_with_aux_hidden(self, items: list[ForwardItem], aux_layers: tuple[int, ...],
                                input_ids: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """``forward``, and the hidden states entering the target's layers ``aux_layers`` for every new token, in
        flat item order: ``(logits fp32 [sum(num_logits), V], aux [sum(len(token_ids)), len(aux_layers) *
        hidden])`` (``LlamaForCausalLM.forward_with_aux_hidden``; what an EAGLE-3 head is fed). Always eager:
        the static forwards (``cuda_graphs.py``) do not capture hidden states."""
        meta, ids, positions, logits_indices = self.prepare(items, with_ids=input_ids is None)
        if input_ids is not None:
            assert input_ids.shape == positions.shape, "input_ids must hold one id per new token"
            ids = input_ids
        self.num_forwards += 1
        return self.model.forward_with_aux_hidden(ids, positions, self.pool.tensors, meta, logits_indices,
                                                  aux_layers)

    def _static_forward(self, ids, positions, meta: AttentionMetadata, q_len: int, logits_indices
                        ) -> torch.Tensor | None:
        """The uniform batch through its static bucket, or None (no bucket serves it: run it eagerly). A failure
        of the static path (a capture that cannot be made on this device, say) turns it off for good, with a
        warning, and the forward runs eagerly: its K/V writes go to the same slots, so a repeated one is harmless.
        """
        try:
            return self.static.run(ids, positions, meta.slot_mapping, meta.block_tables, meta.seq_lens, q_len,
                                   logits_indices)
        except Exception as exc:  # noqa: BLE001 - any failure of the optional fast path falls back to eager
            logger.warning("static forward (%s) failed, running every forward eagerly from now on: %r",
                           self.static.mode, exc)
            self.static = None
            return None

    def prepare(self, items: list[ForwardItem], with_ids: bool = True, pad_to: int | None = None
                ) -> tuple[AttentionMetadata, torch.Tensor | None, torch.Tensor, torch.Tensor]:
        """The device inputs of a forward over ``items``: ``(meta, input_ids int64 [T] or None, positions int64
        [T], logits_indices int64 [N])``, views of the staging buffer valid until the next ``prepare``.

        ``pad_to`` (``padded_q_len``'s answer; causal items with ids only): each item's window is followed by
        ``pad_to - len(token_ids)`` padding tokens (id 0, the window's last RoPE position, K/V slots in the scratch
        block, no logits), so ``T = len(items) * pad_to`` and the batch is uniform. Its attention reads the table
        entries up to ``start + pad_to`` (a block of the sequence's, or block 0 beyond its table: stale values,
        read only, by the padding queries alone).

        Raises ``RuntimeError`` (before anything is staged) if a new token's slot lies in a block that is
        shared or registered in the prefix cache (``BlockManager.slot``'s rule)."""
        bm = self.block_manager
        bs = bm.block_size
        read_only = bm.read_only
        num_seqs = len(items)
        token_ids: list[int] = []
        positions: list[int] = []  # RoPE positions
        slots: list[int] = []
        logits_indices: list[int] = []
        cu_q_lens = [0]
        seq_lens: list[int] = []
        rows: list[int] = []  # each item's row of bm.table_array
        width = 0  # blocks of the longest table: the block tables' padded width
        masks: list[np.ndarray | None] = []  # each item's tree mask, flat, on the host
        mask_numel = 0  # bool entries of every tree mask, packed
        cu = 0
        if pad_to is not None:
            assert with_ids and self.scratch_block is not None, "padding needs the ids and the scratch block"
            scratch_slot = self.scratch_block * bs
        for item in items:
            seq_id, start = item.seq_id, item.start_pos
            n = len(item.token_ids)
            end = start + n
            table = bm.block_table(seq_id)
            assert bm.seq_len(seq_id) >= end, "slots not reserved before the forward"
            if n == 1:  # a decode or draft step: one slot
                block = table[start // bs]
                if read_only[block]:
                    bm.slot(seq_id, start)  # raises, naming the sequence, position and block
                slots.append(block * bs + start % bs)
            else:  # block by block: the slots within one block are consecutive
                for i in range(start // bs, (end - 1) // bs + 1):
                    block = table[i]
                    lo = max(start, i * bs)
                    if read_only[block]:
                        bm.slot(seq_id, lo)  # raises
                    offset = (block - i) * bs  # slot of logical position p in this block: p + offset
                    slots += range(lo + offset, min(end, i * bs + bs) + offset)
            if item.positions is None:
                positions += range(start, end)
            else:
                positions += item.positions
            if with_ids:
                token_ids += item.token_ids
            logits_indices += range(cu + n - item.num_logits, cu + n)
            if pad_to is not None and pad_to > n:
                pad = pad_to - n
                # NOTE: the padding's RoPE position repeats the window's last one: end + j may lie past the rope
                # table (a request near max_model_len); its outputs are dropped, so any valid position serves
                positions += [end - 1] * pad
                slots += (scratch_slot + j % bs for j in range(pad))
                token_ids += [0] * pad
                n, end = pad_to, end + pad
            cu += n
            cu_q_lens.append(cu)
            seq_lens.append(end)
            rows.append(bm.row_of(seq_id))
            width = max(width, len(table), -(-end // bs))
            mask = None if item.mask is None else _host_mask(item.mask)
            masks.append(mask)
            if mask is not None:
                mask_numel += mask.size
        has_mask = any(m is not None for m in masks)

        # One staging buffer, one section per array, grouped by dtype (each run of same-dtype sections is one slice
        # on the device): int64, then int32, then the tree masks (bool). The block tables are gathered from the
        # persistent rows.
        sections = [(cu, np.int64), (cu, np.int64), (len(logits_indices), np.int64)]
        if with_ids:
            sections.append((cu, np.int64))
        sections += [(num_seqs, np.int32), (num_seqs + 1, np.int32), (num_seqs * width, np.int32)]
        if has_mask:
            sections += [(num_seqs + 1, np.int32), (mask_numel, np.bool_)]
        staged = self.staging.stage(sections)
        staged[0][:] = positions
        staged[1][:] = slots
        staged[2][:] = logits_indices
        i = 3
        if with_ids:
            staged[3][:] = token_ids
            i = 4
        staged[i][:] = seq_lens
        staged[i + 1][:] = cu_q_lens
        bm.table_array[:, :width].take(rows, axis=0, out=staged[i + 2].reshape(num_seqs, width))
        if has_mask:
            _pack_masks(masks, staged[i + 3], staged[i + 4])

        # the forward's one host-to-device copy (tree masks included); on CPU the host memory itself
        on_device = self.staging.to_device()
        dev_positions, dev_slots, dev_logits = on_device[:3]
        dev_ids = on_device[3] if with_ids else None
        dev_seq_lens, dev_cu, dev_tables = on_device[i : i + 3]
        meta = AttentionMetadata(
            slot_mapping=dev_slots,
            block_tables=dev_tables.view(num_seqs, width),
            seq_lens=dev_seq_lens,
            cu_q_lens=dev_cu,
            tree_mask=on_device[i + 4] if has_mask else None,
            tree_mask_indptr=on_device[i + 3] if has_mask else None,
        )
        return meta, dev_ids, dev_positions, dev_logits


def _pack_masks(masks: list[np.ndarray | None], indptr: np.ndarray, flat: np.ndarray) -> None:
    """Write the paged-attention kernel's packed tree masks into staged host memory: ``flat`` bool
    ``[sum(q_len_b * w_b)]`` (each ``[q_len_b, w_b]`` mask row-major, given flat in ``masks``) and ``indptr`` int32
    ``[B+1]`` (sequence b's slice of ``flat``). An item without a mask gets an empty slice (causal). The masks thus
    travel with the rest of the metadata in the forward's one copy: no pageable ``.to(device)`` and no
    ``torch.tensor(..., device=...)``, each of which synchronises the stream on CUDA."""
    offset = 0
    indptr[0] = 0
    for b, mask in enumerate(masks):
        if mask is not None:
            flat[offset : offset + mask.size] = mask
            offset += mask.size
        indptr[b + 1] = offset


def _host_mask(mask) -> np.ndarray:
    """A tree mask's entries as a flat numpy array (a CPU tensor's memory, not a copy); ``ValueError`` for a mask
    on a device (reading it back would be a host sync), raised before anything is staged."""
    if isinstance(mask, torch.Tensor):
        if mask.device.type != "cpu":
            raise ValueError(f"a ForwardItem's tree mask must be a host tensor, got one on {mask.device} (staging it "
                             "would read it back: a host sync)")
        return mask.detach().reshape(-1).numpy()
    return np.asarray(mask).reshape(-1)
