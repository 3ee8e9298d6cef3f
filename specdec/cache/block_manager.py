"""Plain-Python block manager: a free list of KV-cache blocks and one block table per sequence.

Every block is owned by exactly one sequence or free. A sequence's *length* is the number of tokens whose
K/V slots are reserved for it; ``truncate_to`` (the mirror of ``append_slots``) gives back every block
wholly beyond the new length - that is the speculative rollback.
"""

from __future__ import annotations

from collections import deque


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int):
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"num_blocks and block_size must be >= 1, got {num_blocks}, {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._free: deque[int] = deque(range(num_blocks))
        self._tables: dict[int, list[int]] = {}  # seq id -> physical block ids in logical order
        self._lens: dict[int, int] = {}  # seq id -> reserved token slots

    # --- queries -------------------------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def has_seq(self, seq_id: int) -> bool:
        return seq_id in self._tables

    def seq_len(self, seq_id: int) -> int:
        return self._lens[seq_id]

    def block_table(self, seq_id: int) -> list[int]:
        return self._tables[seq_id]

    def can_allocate(self, num_tokens: int) -> bool:
        return self.blocks_needed(num_tokens) <= len(self._free)

    def can_append(self, seq_id: int, num_new: int) -> bool:
        return self._extra_blocks(seq_id, num_new) <= len(self._free)

    def slot(self, seq_id: int, pos: int) -> int:
        """Flat cache slot of the token at logical position ``pos`` of ``seq_id``."""
        return self._tables[seq_id][pos // self.block_size] * self.block_size + pos % self.block_size

    # --- mutations -----------------------------------------------------------------------------------------
    def allocate(self, seq_id: int, num_tokens: int) -> None:
        """Reserve slots for the first ``num_tokens`` tokens of a new sequence."""
        assert seq_id not in self._tables, f"sequence {seq_id} already has blocks"
        if not self.can_allocate(num_tokens):
            raise MemoryError(f"{self.blocks_needed(num_tokens)} blocks needed, {len(self._free)} free")
        self._tables[seq_id] = [self._free.popleft() for _ in range(self.blocks_needed(num_tokens))]
        self._lens[seq_id] = num_tokens

    def append_slots(self, seq_id: int, num_new: int) -> None:
        """Reserve ``num_new`` more slots at the end of ``seq_id``."""
        extra = self._extra_blocks(seq_id, num_new)
        if extra > len(self._free):
            raise MemoryError(f"{extra} blocks needed, {len(self._free)} free")
        self._tables[seq_id].extend(self._free.popleft() for _ in range(extra))
        self._lens[seq_id] += num_new

    def truncate_to(self, seq_id: int, new_len: int) -> int:
        """Shrink ``seq_id`` to ``new_len`` slots, freeing every block wholly beyond ``new_len``; returns how many."""
        assert 0 <= new_len <= self._lens[seq_id], f"truncate_to({new_len}) beyond length {self._lens[seq_id]}"
        table = self._tables[seq_id]
        keep = self.blocks_needed(new_len)
        freed = len(table) - keep
        self._free.extend(table[keep:])
        del table[keep:]
        self._lens[seq_id] = new_len
        return freed

    def free(self, seq_id: int) -> None:
        """Give back all blocks of ``seq_id`` (a no-op for unknown ids)."""
        table = self._tables.pop(seq_id, None)
        if table is not None:
            self._free.extend(table)
            del self._lens[seq_id]

    def _extra_blocks(self, seq_id: int, num_new: int) -> int:
        return self.blocks_needed(self._lens[seq_id] + num_new) - len(self._tables[seq_id])

    def check_invariants(self) -> None:
        """Assert: every block is free or owned by exactly one sequence; tables match lengths."""
        owned = [b for table in self._tables.values() for b in table]
        all_blocks = owned + list(self._free)
        assert len(all_blocks) == len(set(all_blocks)) == self.num_blocks, "a block is leaked or double-owned"
        for seq_id, table in self._tables.items():
            assert len(table) == self.blocks_needed(self._lens[seq_id]), f"sequence {seq_id} table/length mismatch"
