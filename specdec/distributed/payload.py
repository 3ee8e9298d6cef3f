"""What the driver sends the workers: each command's header as a few int64s, and a forward's inputs as one
int64 payload.

A header (``ForwardHeader``, ``CompactHeader``, ``ShutdownHeader``) says what comes next and how big its payload
is, so that a worker can allocate it; ``header_to_ints`` / ``header_from_ints`` turn it into the fixed-size int64
prefix that ``channel.py`` broadcasts. A forward's payload is token ids, RoPE positions, slots, logits rows,
``seq_lens``, ``cu_q_lens``, the block tables and, for tree windows, the packed masks with their offsets,
concatenated in that order. Int32 and bool sections are widened to int64 (a few hundred bytes per forward at
these sizes; one collective instead of one per section).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from specdec.model.llama import AttentionMetadata

FORWARD, COMPACT, SHUTDOWN = 1, 2, 3  # a header's command (its first int)
HEADER_LEN = 8  # ints of an encoded header: the command and up to 7 fields


@dataclass(frozen=True)
class ForwardHeader:
    """The sizes of one forward's payload (broadcast before the payload)."""

    model_id: int  # 0: the target, 1: the draft
    num_tokens: int  # T
    num_logits: int  # N
    num_seqs: int  # B
    table_width: int  # W: blocks per block-table row
    mask_numel: int  # entries of the packed tree masks; -1: no tree mask
    uniform_q_len: int | None

    @property
    def numel(self) -> int:
        n = 3 * self.num_tokens + self.num_logits + 2 * self.num_seqs + 1 + self.num_seqs * self.table_width
        return n + (self.num_seqs + 1 + self.mask_numel if self.mask_numel >= 0 else 0)


@dataclass(frozen=True)
class CompactHeader:
    """A KV compaction of ``num_moves`` slot moves in the pool of model ``model_id``."""

    model_id: int
    num_moves: int

    @property
    def numel(self) -> int:
        """The payload: source slots then destination slots."""
        return 2 * self.num_moves


@dataclass(frozen=True)
class ShutdownHeader:
    """The driver is shutting down: the workers leave their serve loop (no payload)."""

    numel = 0


Header = ForwardHeader | CompactHeader | ShutdownHeader


def header_to_ints(header: Header) -> list[int]:
    """``header`` as ``HEADER_LEN`` ints: its command, then its fields (``uniform_q_len`` None as -1), zero-padded."""
    if isinstance(header, ForwardHeader):
        q_len = -1 if header.uniform_q_len is None else header.uniform_q_len
        ints = [FORWARD, header.model_id, header.num_tokens, header.num_logits, header.num_seqs, header.table_width,
                header.mask_numel, q_len]
    elif isinstance(header, CompactHeader):
        ints = [COMPACT, header.model_id, header.num_moves]
    elif isinstance(header, ShutdownHeader):
        ints = [SHUTDOWN]
    else:
        raise TypeError(f"not a header: {header!r}")
    return ints + [0] * (HEADER_LEN - len(ints))


def header_from_ints(ints: list[int]) -> Header:
    """The header ``header_to_ints`` encoded; ``RuntimeError`` for an unknown command."""
    command = ints[0]
    if command == FORWARD:
        model_id, t, n, b, w, mask_numel, q_len = ints[1:8]
        return ForwardHeader(model_id, t, n, b, w, mask_numel, None if q_len < 0 else q_len)
    if command == COMPACT:
        return CompactHeader(ints[1], ints[2])
    if command == SHUTDOWN:
        return ShutdownHeader()
    raise RuntimeError(f"unknown command from the driver: {ints!r}")


def pack_forward(model_id: int, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                 logits_indices: torch.Tensor) -> tuple[ForwardHeader, torch.Tensor]:
    """(header, payload int64 ``[header.numel]`` on the inputs' device) of one forward: ``input_ids, positions
    int64 [T]``, ``meta`` (slots int64 ``[T]``, seq_lens int32 ``[B]``, cu_q_lens int32 ``[B+1]``, block tables
    int32 ``[B, W]``, optional tree masks), ``logits_indices int64 [N]``."""
    num_seqs, width = meta.block_tables.shape
    parts = [input_ids, positions, meta.slot_mapping, logits_indices, meta.seq_lens, meta.cu_q_lens,
             meta.block_tables.reshape(-1)]
    mask_numel = -1
    if meta.tree_mask is not None:
        parts += [meta.tree_mask_indptr, meta.tree_mask.reshape(-1)]
        mask_numel = meta.tree_mask.numel()
    header = ForwardHeader(model_id, input_ids.shape[0], logits_indices.shape[0], num_seqs, width, mask_numel,
                           meta.uniform_q_len)
    payload = torch.cat([p.to(torch.int64) for p in parts])  # (header.numel,)
    assert payload.shape[0] == header.numel, "payload sections do not match the header"
    return header, payload


def unpack_forward(header: ForwardHeader, payload: torch.Tensor
                   ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata, torch.Tensor]:
    """``(input_ids, positions, meta, logits_indices)`` from a broadcast payload (the inverse of ``pack_forward``,
    dtypes restored)."""
    t, n, b, w = header.num_tokens, header.num_logits, header.num_seqs, header.table_width
    sizes = [t, t, t, n, b, b + 1, b * w]
    if header.mask_numel >= 0:
        sizes += [b + 1, header.mask_numel]
    parts = payload.split(sizes)
    meta = AttentionMetadata(
        slot_mapping=parts[2],
        block_tables=parts[6].to(torch.int32).view(b, w),
        seq_lens=parts[4].to(torch.int32),
        cu_q_lens=parts[5].to(torch.int32),
        tree_mask=parts[8].to(torch.bool) if header.mask_numel >= 0 else None,
        tree_mask_indptr=parts[7].to(torch.int32) if header.mask_numel >= 0 else None,
        uniform_q_len=header.uniform_q_len,
    )
    return parts[0], parts[1], meta, parts[3]
