"""Prefix caching: full KV blocks keyed by a chained hash of their tokens (the scheme of vLLM's v1 KV cache manager).

A full block's key is ``sha256(parent key || its block_size token ids as int64)``, the parent key being the key of
the block before it (``ROOT`` for a sequence's first block). Equal keys therefore mean equal tokens from position 0
up to the end of that block, so the K/V one request computed for them can be read by another. sha256 and not
Python's ``hash``: a crafted prompt must not be able to collide with another user's prefix and read its K/V.

This class only maps keys to blocks and keeps each sequence's chain of keys; reference counts, the free list and
LRU eviction are the ``BlockManager``'s. Only blocks whose tokens are all *committed* (K/V written by a finished
forward, positions < ``num_computed``) are ever registered - never speculative tokens.
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Sequence

ROOT = b""  # the parent key of a sequence's first block


def block_key(parent: bytes, token_ids: Sequence[int]) -> bytes:
    """The key of a full block: sha256 over its parent's key and its token ids (int64, native order)."""
    return hashlib.sha256(parent + array("q", token_ids).tobytes()).digest()


class PrefixCache:
    """Key <-> block maps of the registered (full, committed) blocks, and each sequence's chain of keys."""

    def __init__(self, block_size: int):
        self.block_size = block_size
        self._block_of: dict[bytes, int] = {}  # key -> the registered block holding those tokens' K/V
        self._key_of: dict[int, bytes] = {}  # registered block -> its key
        # seq id -> keys of its leading full, committed blocks, in table order. A key whose tokens another block
        # already holds (two requests computed the same prefix at once) is in the chain, but this sequence's
        # block stays unregistered and private.
        self._chains: dict[int, list[bytes]] = {}

    # --- queries -------------------------------------------------------------------------------------------
    def is_registered(self, block: int) -> bool:
        return block in self._key_of

    def key_of(self, block: int) -> bytes | None:
        return self._key_of.get(block)

    def __len__(self) -> int:
        return len(self._block_of)

    def num_chained(self, seq_id: int) -> int:
        """How many leading blocks of ``seq_id`` have their key in its chain (0 for unknown ids)."""
        chain = self._chains.get(seq_id)
        return len(chain) if chain is not None else 0

    def chain(self, seq_id: int) -> list[bytes]:
        return self._chains.get(seq_id, [])

    def match(self, token_ids: Sequence[int]) -> tuple[list[bytes], list[int]]:
        """(keys, blocks) of the longest run of registered full blocks that starts ``token_ids``; the keys are
        computed lazily, so a miss on the first block costs one hash."""
        bs = self.block_size
        keys: list[bytes] = []
        blocks: list[int] = []
        parent = ROOT
        for i in range(len(token_ids) // bs):
            key = block_key(parent, token_ids[i * bs : (i + 1) * bs])
            block = self._block_of.get(key)
            if block is None:
                break
            keys.append(key)
            blocks.append(block)
            parent = key
        return keys, blocks

    # --- mutations -----------------------------------------------------------------------------------------
    def start(self, seq_id: int, keys: list[bytes]) -> None:
        """A new sequence whose first ``len(keys)`` blocks are the cached blocks it matched."""
        self._chains[seq_id] = list(keys)

    def register(self, seq_id: int, table: list[int], token_ids: Sequence[int]) -> int:
        """Chain (and register, unless the key is already held by another block) every block of ``table`` that
        ``token_ids`` - the sequence's committed tokens - fill completely and that is not chained yet. Returns
        how many blocks were newly registered."""
        bs = self.block_size
        chain = self._chains.setdefault(seq_id, [])
        num_full = min(len(token_ids) // bs, len(table))
        registered = 0
        for i in range(len(chain), num_full):
            key = block_key(chain[-1] if chain else ROOT, token_ids[i * bs : (i + 1) * bs])
            chain.append(key)
            block = table[i]
            assert block not in self._key_of, f"block {block} is registered twice"
            if key not in self._block_of:
                self._block_of[key] = block
                self._key_of[block] = key
                registered += 1
        return registered

    def drop(self, seq_id: int) -> None:
        """Forget the chain of a sequence that gives its blocks back (its registered blocks stay registered)."""
        self._chains.pop(seq_id, None)

    def evict(self, block: int) -> None:
        """Unregister ``block`` (its memory is about to hold other tokens)."""
        key = self._key_of.pop(block)
        del self._block_of[key]

    def check_invariants(self) -> None:
        assert len(self._block_of) == len(self._key_of), "key and block maps differ in size"
        for key, block in self._block_of.items():
            assert self._key_of.get(block) == key, f"block {block} and key maps disagree"
