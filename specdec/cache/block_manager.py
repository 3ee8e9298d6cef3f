"""Plain-Python block manager: reference-counted KV-cache blocks, one block table per sequence, and (optionally)
prefix caching with LRU eviction.

A sequence's *length* is the number of tokens whose K/V slots are reserved for it; ``truncate_to`` (the mirror of
``append_slots``) gives back every block wholly beyond the new length - that is the speculative rollback.

Every block is in exactly one of three states (``check_invariants``):

- **referenced**: in the tables of ``refcount >= 1`` sequences. More than one only for a registered prefix block;
- **free**: unreferenced and holding nothing anyone can find (``_free``, FIFO);
- **evictable** (prefix caching only): unreferenced but registered in the prefix cache, so a later request with
  the same prefix can take it back instead of recomputing it (``_evictable``, least recently released first).

New blocks come from the free list first, then by evicting the least recently released evictable block. A
sequence's blocks are released tail first, so a request's last blocks (the least likely to be shared, and useless
without the ones before them) are evicted before its first ones.

Writes (``slot``) are only allowed into a block that this sequence alone holds and that is not registered: a
shared or cached block is never overwritten, whatever a rollback, a preemption or a failed step does.

Besides the tables as Python lists (the source of truth), the manager keeps them in a persistent int32 array,
``table_array`` ``[rows, width]``: each sequence owns a row (``row_of``) from allocation to ``free``, updated
incrementally as blocks are appended or given back (entries past a table's end are 0), both dimensions grown
geometrically. With ``read_only`` (bool ``[num_blocks]``, the blocks ``slot`` refuses to write), it lets the model
runner gather a batch's block tables and slot mapping with a few numpy operations instead of per-token Python.

Over 300 lines: the three block states and the table array are kept in step by every mutation, and
``check_invariants`` states them in one place; splitting the mutations apart would hide who keeps them.
"""

from __future__ import annotations

from collections import Counter, OrderedDict, deque
from collections.abc import Sequence

import numpy as np

from specdec.cache.prefix_cache import PrefixCache

# Tokens at the end of a sequence that are never served from the prefix cache. One so that the forward has logits to
# sample from; two so that the admission step is always a prefill of >= 2 tokens, as without the cache - a 1-token
# step is a decode step to a speculative engine, which would draft there and draw the request's first token from
# other random streams than the uncached run does (docs/architecture.md, "Prefix caching").
RECOMPUTED_TAIL = 2
INITIAL_TABLE_ROWS = 8  # table_array rows (sequences holding blocks at once) before the first growth
INITIAL_TABLE_WIDTH = 16  # table_array columns (blocks of the longest table) before the first growth


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = False):
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"num_blocks and block_size must be >= 1, got {num_blocks}, {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._free: deque[int] = deque(range(num_blocks))  # unreferenced, unregistered
        self._evictable: OrderedDict[int, None] = OrderedDict()  # unreferenced, registered; LRU first
        self._refs = [0] * num_blocks  # block -> number of tables holding it
        self._tables: dict[int, list[int]] = {}  # seq id -> physical block ids in logical order
        self._lens: dict[int, int] = {}  # seq id -> reserved token slots
        self.prefix_cache = PrefixCache(block_size) if enable_prefix_caching else None
        self.num_queried_tokens = 0  # tokens of the sequences allocated with their token ids (prefix caching)
        self.num_cached_tokens = 0  # of those, tokens served from the prefix cache
        self.num_evicted_blocks = 0  # cached blocks whose memory was taken for other tokens
        # The tables again as one persistent array (module docstring): int32 [rows, width], row_of[seq id].
        self.table_array = np.zeros((INITIAL_TABLE_ROWS, INITIAL_TABLE_WIDTH), dtype=np.int32)
        self._row_of: dict[int, int] = {}
        self._free_rows: list[int] = list(range(INITIAL_TABLE_ROWS - 1, -1, -1))  # popped from the end: 0 first
        self.read_only = np.ones(num_blocks, dtype=bool)  # [num_blocks] not held by one sequence alone, or registered

    # --- queries -------------------------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        """Blocks an allocation can take: free ones plus evictable cached ones."""
        return len(self._free) + len(self._evictable)

    @property
    def num_evictable_blocks(self) -> int:
        """Unreferenced blocks that still hold a registered prefix (counted in ``num_free_blocks``)."""
        return len(self._evictable)

    @property
    def stats(self) -> dict:
        """``prefix_cache_queries`` / ``prefix_cache_hits``: tokens of admitted requests looked up / served from
        the cache; ``prefix_cache_evicted_blocks``: cached blocks evicted (docs/metrics.md)."""
        return {"prefix_cache_queries": self.num_queried_tokens, "prefix_cache_hits": self.num_cached_tokens,
                "prefix_cache_evicted_blocks": self.num_evicted_blocks}

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def has_seq(self, seq_id: int) -> bool:
        return seq_id in self._tables

    def seq_len(self, seq_id: int) -> int:
        return self._lens[seq_id]

    def seq_len_or_none(self, seq_id: int) -> int | None:
        """``seq_len(seq_id)``, or None when ``seq_id`` holds no blocks (one lookup for the scheduler)."""
        return self._lens.get(seq_id)

    def block_table(self, seq_id: int) -> list[int]:
        return self._tables[seq_id]

    def row_of(self, seq_id: int) -> int:
        """The row of ``table_array`` that holds ``seq_id``'s block table (``KeyError`` for unknown ids)."""
        return self._row_of[seq_id]

    def refcount(self, block: int) -> int:
        return self._refs[block]

    def can_allocate(self, num_tokens: int, token_ids: Sequence[int] | None = None) -> bool:
        """Whether ``allocate(seq, num_tokens, token_ids)`` would succeed now."""
        _, hit = self._cached_prefix(num_tokens, token_ids)
        revived = sum(1 for b in hit if self._refs[b] == 0)  # evictable blocks taken back are not free any more
        return self.blocks_needed(num_tokens) - len(hit) <= self.num_free_blocks - revived

    def can_append(self, seq_id: int, num_new: int) -> bool:
        return self._extra_blocks(seq_id, num_new) <= self.num_free_blocks

    @staticmethod
    def cacheable_len(num_tokens: int) -> int:
        """How many leading tokens of a sequence of ``num_tokens`` tokens may be served from the cache."""
        return max(0, num_tokens - RECOMPUTED_TAIL)

    def cached_prefix_len(self, num_tokens: int, token_ids: Sequence[int] | None) -> int:
        """Tokens ``allocate`` would serve from the cache (a query: changes nothing, counts nothing)."""
        return len(self._cached_prefix(num_tokens, token_ids)[1]) * self.block_size

    def slot(self, seq_id: int, pos: int) -> int:
        """Flat cache slot where the K/V of the token at logical position ``pos`` of ``seq_id`` is *written*.

        Raises ``RuntimeError`` if that block is shared or registered in the prefix cache: such a block is
        read-only (docs/architecture.md, "Prefix caching")."""
        block = self._tables[seq_id][pos // self.block_size]
        if self._refs[block] != 1 or (self.prefix_cache is not None and self.prefix_cache.is_registered(block)):
            raise RuntimeError(f"refusing to write position {pos} of sequence {seq_id} into block {block}: it is "
                               f"shared ({self._refs[block]} holders) or a registered prefix block")
        return block * self.block_size + pos % self.block_size

    # --- mutations -----------------------------------------------------------------------------------------
    def allocate(self, seq_id: int, num_tokens: int, token_ids: Sequence[int] | None = None) -> int:
        """Reserve slots for the first ``num_tokens`` tokens of a new sequence; returns how many of them are
        served from the prefix cache (a multiple of ``block_size``; 0 without prefix caching or ``token_ids``).

        ``token_ids``: the sequence's tokens, to look its prefix up in the cache. The longest run of cached full
        blocks within ``token_ids[:-RECOMPUTED_TAIL]`` is shared (the last two tokens are always recomputed: see
        ``RECOMPUTED_TAIL``); the rest are new blocks.
        """
        assert seq_id not in self._tables, f"sequence {seq_id} already has blocks"
        if not self.can_allocate(num_tokens, token_ids):
            raise MemoryError(f"{self.blocks_needed(num_tokens)} blocks needed, {self.num_free_blocks} free")
        keys, hit = self._cached_prefix(num_tokens, token_ids)
        for block in hit:
            self._ref(block)
        table = hit + [self._take() for _ in range(self.blocks_needed(num_tokens) - len(hit))]
        self._tables[seq_id] = table
        self._lens[seq_id] = num_tokens
        self._row_of[seq_id] = row = self._take_row()
        self._ensure_width(len(table))
        self.table_array[row, : len(table)] = table
        if self.prefix_cache is not None:
            self.prefix_cache.start(seq_id, keys)
            if token_ids is not None:
                self.num_queried_tokens += len(token_ids)
                self.num_cached_tokens += len(hit) * self.block_size
        return len(hit) * self.block_size

    def append_slots(self, seq_id: int, num_new: int) -> None:
        """Reserve ``num_new`` more slots at the end of ``seq_id``."""
        extra = self._extra_blocks(seq_id, num_new)
        if extra > self.num_free_blocks:
            raise MemoryError(f"{extra} blocks needed, {self.num_free_blocks} free")
        if extra > 0:
            table = self._tables[seq_id]
            old = len(table)
            table.extend(self._take() for _ in range(extra))
            self._ensure_width(len(table))
            self.table_array[self._row_of[seq_id], old : len(table)] = table[old:]
        self._lens[seq_id] += num_new

    def try_reserve(self, seq_id: int, target_len: int) -> bool:
        """Grow a held sequence to at least ``target_len`` slots if the pool allows; False (nothing changed)
        when it does not. ``append_slots`` for the scheduler's common case, in one call."""
        missing = target_len - self._lens[seq_id]
        if missing <= 0:
            return True
        if self.blocks_needed(target_len) <= len(self._tables[seq_id]):  # within its last block: no new block
            self._lens[seq_id] = target_len
            return True
        if self._extra_blocks(seq_id, missing) > self.num_free_blocks:
            return False
        self.append_slots(seq_id, missing)
        return True

    def truncate_to(self, seq_id: int, new_len: int) -> int:
        """Shrink ``seq_id`` to ``new_len`` slots, giving back every block wholly beyond ``new_len``; returns how
        many. Refuses (``ValueError``) to cut into the sequence's chained prefix blocks: those hold committed
        tokens another request may share, and a rollback never goes below the committed length."""
        assert 0 <= new_len <= self._lens[seq_id], f"truncate_to({new_len}) beyond length {self._lens[seq_id]}"
        chained = self.prefix_cache.num_chained(seq_id) if self.prefix_cache is not None else 0
        if new_len < chained * self.block_size:
            raise ValueError(f"truncate_to({new_len}) would cut into the {chained} committed prefix blocks of "
                             f"sequence {seq_id} ({chained * self.block_size} tokens)")
        table = self._tables[seq_id]
        keep = self.blocks_needed(new_len)
        freed = table[keep:]
        del table[keep:]
        self.table_array[self._row_of[seq_id], keep : keep + len(freed)] = 0
        for block in reversed(freed):
            self._release(block)
        self._lens[seq_id] = new_len
        return len(freed)

    def register_committed(self, seq_id: int, token_ids: Sequence[int]) -> int:
        """Register in the prefix cache every full block of ``seq_id`` that ``token_ids`` - its tokens whose
        K/V are committed (never speculative ones) - now fill; returns how many were newly registered."""
        if self.prefix_cache is None or seq_id not in self._tables:
            return 0
        table = self._tables[seq_id]
        num_before = self.prefix_cache.num_chained(seq_id)
        registered = self.prefix_cache.register(seq_id, table, token_ids)
        for block in table[num_before : self.prefix_cache.num_chained(seq_id)]:
            self._update_read_only(block)
        return registered

    def num_chained_blocks(self, seq_id: int) -> int:
        """Leading blocks of ``seq_id`` already offered to the prefix cache (0 without prefix caching)."""
        return self.prefix_cache.num_chained(seq_id) if self.prefix_cache is not None else 0

    def free(self, seq_id: int) -> None:
        """Drop ``seq_id``'s references to its blocks (a no-op for unknown ids). A block nobody else holds
        becomes free, or evictable if it is registered in the prefix cache."""
        table = self._tables.pop(seq_id, None)
        if table is not None:
            del self._lens[seq_id]
            row = self._row_of.pop(seq_id)
            self.table_array[row, : len(table)] = 0
            self._free_rows.append(row)
            if self.prefix_cache is not None:
                self.prefix_cache.drop(seq_id)
            for block in reversed(table):  # tail first: a prefix's last blocks are evicted before its first
                self._release(block)

    # --- internals -----------------------------------------------------------------------------------------
    def _cached_prefix(self, num_tokens: int, token_ids: Sequence[int] | None) -> tuple[list[bytes], list[int]]:
        """(keys, blocks) of the cached full blocks a new sequence of ``num_tokens`` slots would share."""
        if self.prefix_cache is None or token_ids is None:
            return [], []
        cacheable = min(self.cacheable_len(len(token_ids)), num_tokens)
        return self.prefix_cache.match(token_ids[:cacheable]) if cacheable >= self.block_size else ([], [])

    def _take(self) -> int:
        """A block for new tokens: a free one, else the least recently released evictable one (evicted)."""
        if self._free:
            block = self._free.popleft()
        else:
            block, _ = self._evictable.popitem(last=False)
            self.prefix_cache.evict(block)
            self.num_evicted_blocks += 1
        self._refs[block] = 1
        self.read_only[block] = False  # held by one sequence, unregistered (an evicted block no longer is)
        return block

    def _ref(self, block: int) -> None:
        if self._refs[block] == 0:
            del self._evictable[block]  # a cached block taken back: no longer evictable
        self._refs[block] += 1
        self._update_read_only(block)

    def _release(self, block: int) -> None:
        self._refs[block] -= 1
        assert self._refs[block] >= 0, f"block {block} released more often than referenced"
        self._update_read_only(block)
        if self._refs[block] == 0:
            if self.prefix_cache is not None and self.prefix_cache.is_registered(block):
                self._evictable[block] = None  # most recently released: evicted last
            else:
                self._free.append(block)

    def _update_read_only(self, block: int) -> None:
        """``read_only[block]``: what ``slot`` checks - shared (or unreferenced) or registered."""
        self.read_only[block] = self._refs[block] != 1 or (
            self.prefix_cache is not None and self.prefix_cache.is_registered(block))

    def _take_row(self) -> int:
        """A free row of ``table_array`` (all zeros), doubling the rows when none is left."""
        if not self._free_rows:
            rows, width = self.table_array.shape
            grown = np.zeros((2 * rows, width), dtype=np.int32)
            grown[:rows] = self.table_array
            self.table_array = grown
            self._free_rows = list(range(2 * rows - 1, rows - 1, -1))
        return self._free_rows.pop()

    def _ensure_width(self, num_blocks: int) -> None:
        """Widen ``table_array`` (doubling) until a table of ``num_blocks`` blocks fits."""
        rows, width = self.table_array.shape
        if num_blocks > width:
            new_width = max(2 * width, num_blocks)
            grown = np.zeros((rows, new_width), dtype=np.int32)
            grown[:, :width] = self.table_array
            self.table_array = grown

    def _extra_blocks(self, seq_id: int, num_new: int) -> int:
        return self.blocks_needed(self._lens[seq_id] + num_new) - len(self._tables[seq_id])

    def check_invariants(self) -> None:
        """Assert: every block is referenced (by as many tables as its refcount), free, or evictable - exactly
        one; free blocks are unregistered, evictable ones registered; tables match lengths; a block a sequence
        may still write (beyond its chained prefix) is held by that sequence alone and unregistered."""
        held = Counter(b for table in self._tables.values() for b in table)
        free, evictable = set(self._free), set(self._evictable)
        assert len(free) == len(self._free), "a block is free twice"
        assert not free & evictable, "a block is both free and evictable"
        cache = self.prefix_cache
        for block in range(self.num_blocks):
            assert self._refs[block] == held[block], f"block {block}: refcount {self._refs[block]} != {held[block]}"
            assert (held[block] > 0) + (block in free) + (block in evictable) == 1, f"block {block} leaked or lost"
            registered = cache is not None and cache.is_registered(block)
            assert block not in free or not registered, f"free block {block} is still registered"
            assert block not in evictable or registered, f"evictable block {block} is not registered"
        for seq_id, table in self._tables.items():
            assert len(table) == len(set(table)), f"sequence {seq_id} holds a block twice"
            assert len(table) == self.blocks_needed(self._lens[seq_id]), f"sequence {seq_id} table/length mismatch"
            chain = cache.chain(seq_id) if cache is not None else []
            assert len(chain) * self.block_size <= self._lens[seq_id], f"sequence {seq_id} chained beyond its length"
            for i, block in enumerate(table):
                if i >= len(chain):
                    assert self._refs[block] == 1 and not (cache is not None and cache.is_registered(block)), \
                        f"writable block {block} of sequence {seq_id} is shared or registered"
                elif cache.is_registered(block):
                    assert cache.key_of(block) == chain[i], f"block {block} of sequence {seq_id} has another key"
                else:
                    assert self._refs[block] == 1, f"unregistered prefix block {block} of sequence {seq_id} is shared"
        rows = set(self._row_of.values())
        assert len(rows) == len(self._row_of) == len(self._tables), "two sequences share a table row"
        assert not rows & set(self._free_rows), "a sequence's table row is also free"
        assert len(rows) + len(self._free_rows) == self.table_array.shape[0], "a table row leaked"
        expected = np.zeros_like(self.table_array)
        for seq_id, table in self._tables.items():
            expected[self._row_of[seq_id], : len(table)] = table
        assert np.array_equal(self.table_array, expected), "table_array differs from the block tables"
        for block in range(self.num_blocks):
            writable = self._refs[block] == 1 and not (cache is not None and cache.is_registered(block))
            assert self.read_only[block] == (not writable), f"read_only[{block}] is stale"
        if cache is not None:
            cache.check_invariants()
