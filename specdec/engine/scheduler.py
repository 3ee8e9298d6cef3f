"""Continuous-batching scheduler with recompute preemption.

Each step: running sequences keep going (decode, or the next prefill chunk), then waiting ones are admitted
while the pool fits their prompt plus lookahead, up to ``max_num_seqs`` and the token budget. When the pool
runs short, the newest running request is preempted - its blocks freed, its tokens kept - and recomputed
later. Randomness depends on (seed, position) only, so a preempted request resumes with the same draws.
The oldest request can always progress because the pool holds at least one full-length sequence, so a valid
request never fails for lack of blocks.

Prefix caching (the first pool, the target's, when it has a prefix cache): a request is admitted with the longest
cached prefix of full blocks of its tokens shared and counted as computed, so only the rest is prefilled. At the
start of every step, and when a request is preempted or retired, the full blocks of its *committed* tokens
(``num_computed``; never speculative ones) are registered, so later requests can share them. A waiting request
whose next uncached block a running request is still prefilling waits one step for it instead of computing it
twice (``_waits_for_shared_prefill``). Other pools (the draft model's) allocate every block and fill it lazily.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from specdec.cache.block_manager import BlockManager
from specdec.engine.sequence import Sequence, Status


def _seq_id(seq: Sequence) -> int:
    return seq.seq_id


@dataclass
class ScheduledBatch:
    seqs: list[Sequence]  # in batch order
    num_new_tokens: list[int]  # tokens of each sequence computed this step (K/V written)

    def __len__(self) -> int:
        return len(self.seqs)


class Scheduler:
    def __init__(
        self,
        block_managers: list[BlockManager],
        max_num_seqs: int,
        max_num_batched_tokens: int,
        lookahead: Callable[[Sequence], int] = lambda seq: 0,
    ):
        # Several pools (target, draft) are allocated in lockstep: a block decision holds for all of them. The first
        # is the target's: its cached prefix decides where a request's computation starts.
        self.block_managers = block_managers
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.lookahead = lookahead  # extra slots a decoding sequence wants (its speculation length)
        self.on_free: list[Callable[[Sequence], None]] = []  # called when a sequence's blocks are freed
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []

    # --- bookkeeping ---------------------------------------------------------------------------------------
    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def finish(self, seq: Sequence) -> None:
        """Retire a finished or aborted sequence and free its blocks in every pool."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self._register(seq)  # what it computed stays cached (evictable) for later requests
        for bm in self.block_managers:
            bm.free(seq.seq_id)
        for hook in self.on_free:
            hook(seq)

    # --- block helpers -------------------------------------------------------------------------------------
    def _can_reserve(self, seq: Sequence, target_len: int, token_ids: list[int] | None = None) -> bool:
        seq_id = seq.seq_id
        for bm in self.block_managers:
            current = bm.seq_len_or_none(seq_id)
            if current is None:
                if not bm.can_allocate(target_len, token_ids):
                    return False
            elif target_len > current and not bm.can_append(seq_id, target_len - current):
                return False
        return True

    def _reserve(self, seq: Sequence, target_len: int, token_ids: list[int] | None = None) -> int:
        """Reserve ``target_len`` slots in every pool; returns the tokens the target pool serves from its prefix
        cache for a newly allocated sequence (0 otherwise)."""
        cached = 0
        seq_id = seq.seq_id
        for i, bm in enumerate(self.block_managers):
            current = bm.seq_len_or_none(seq_id)
            if current is None:
                hit = bm.allocate(seq_id, target_len, token_ids)
                cached = hit if i == 0 else cached
            elif target_len > current:
                bm.append_slots(seq_id, target_len - current)
        return cached

    def _register(self, seq: Sequence) -> None:
        """Offer ``seq``'s newly full blocks of committed tokens (K/V written, positions < ``num_computed``) to
        the pools' prefix caches."""
        for bm in self.block_managers:
            if bm.prefix_cache is not None and bm.has_seq(seq.seq_id) and \
                    seq.num_computed // bm.block_size > bm.num_chained_blocks(seq.seq_id):
                bm.register_committed(seq.seq_id, seq.all_token_ids[: seq.num_computed])

    def _waits_for_shared_prefill(self, seq: Sequence, token_ids: list[int]) -> bool:
        """True if the first block of ``seq`` that the target's cache lacks is being prefilled right now by a
        running request with the same tokens up to there: next step that block is cached, so admitting ``seq``
        now would only compute it twice (n > 1 samples, or many requests with one system prompt, arriving
        together). Running requests always progress, so the wait ends."""
        bm = self.block_managers[0]
        if bm.prefix_cache is None:
            return False
        bs = bm.block_size
        cached = bm.cached_prefix_len(len(token_ids), token_ids)
        end = cached + bs  # the block after the cached prefix, if it is one seq could be served from the cache
        if end > bm.cacheable_len(len(token_ids)):
            return False
        for other in self.running:
            if other.num_computed < end <= other.num_tokens and other.all_token_ids[:end] == token_ids[:end]:
                return True
        return False

    def _try_append(self, seq: Sequence, target_len: int) -> bool:
        """Reserve ``target_len`` slots for a running ``seq`` in every pool if all of them can, else change
        nothing and return False. (One pool: one call; several: check all, then reserve.)"""
        if len(self.block_managers) == 1:
            return self.block_managers[0].try_reserve(seq.seq_id, target_len)
        if not self._can_reserve(seq, target_len):
            return False
        self._reserve(seq, target_len)
        return True

    def _grant(self, seq: Sequence, base: int, desired: int) -> int | None:
        """The largest lookahead in [0, desired] whose slots the pools can reserve, or None."""
        for lookahead in range(desired, -1, -1):
            if self._can_reserve(seq, base + lookahead):
                return lookahead
        return None

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self._register(seq)  # its committed blocks stay cached: resuming may find them again
        for bm in self.block_managers:
            bm.free(seq.seq_id)
        for hook in self.on_free:
            hook(seq)
        seq.num_computed = 0
        seq.status = Status.WAITING
        seq.metrics.num_preemptions += 1
        # Back to the front, oldest first, so it resumes before newer arrivals.
        self.waiting.appendleft(seq)
        self.waiting = deque(sorted(self.waiting, key=lambda s: s.seq_id))

    # --- the step ------------------------------------------------------------------------------------------
    def schedule(self) -> ScheduledBatch:
        budget = self.max_num_batched_tokens
        seqs: list[Sequence] = []
        num_new: list[int] = []
        if any(bm.prefix_cache is not None for bm in self.block_managers):
            for seq in self.running:  # last step's commits: register the blocks they filled
                self._register(seq)
        # 1. running sequences, oldest first; preempt the newest when the pool runs short.
        for seq in sorted(self.running, key=_seq_id):
            if seq.status != Status.RUNNING:  # preempted in this loop
                continue
            remaining = seq.num_tokens - seq.num_computed
            chunk = min(remaining, budget) if remaining > 1 else remaining
            if chunk <= 0:
                continue
            base = seq.num_computed + chunk
            desired = self.lookahead(seq) if chunk == remaining else 0
            if desired == 0 and self._try_append(seq, base):  # the common plain decode: one call per pool
                seq.lookahead = 0
                seqs.append(seq)
                num_new.append(chunk)
                budget -= chunk
                continue
            # Under pressure, shrink the lookahead (speculation length) first, then preempt the newest.
            granted = self._grant(seq, base, desired)
            while granted is None:
                victim = max(self.running, key=lambda s: s.seq_id)
                self._preempt(victim)
                if victim is seq:
                    break
                granted = self._grant(seq, base, desired)
            if seq.status != Status.RUNNING:
                continue
            self._reserve(seq, base + granted)
            seq.lookahead = granted
            seqs.append(seq)
            num_new.append(chunk)
            budget -= chunk
        # 2. admit waiting sequences while pool, batch size and token budget allow.
        while self.waiting and len(self.running) < self.max_num_seqs and budget > 0:
            seq = self.waiting[0]
            tokens = seq.all_token_ids  # a preempted request's outputs too: its own blocks may still be cached
            # Reserve the whole prompt (+ lookahead) up front so later chunks never need new blocks.
            lookahead = self.lookahead(seq)
            if not self._can_reserve(seq, seq.num_tokens + lookahead, tokens):
                break
            if self._waits_for_shared_prefill(seq, tokens):
                break
            self.waiting.popleft()
            seq.num_computed = self._reserve(seq, seq.num_tokens + lookahead, tokens)  # the cached prefix
            if seq.metrics.num_preemptions == 0:  # first admission (as vLLM: the prompt's cached tokens)
                seq.metrics.num_cached_tokens = seq.num_computed
            remaining = seq.num_tokens - seq.num_computed
            chunk = min(remaining, budget)
            seq.lookahead = lookahead if chunk == remaining else 0
            seq.status = Status.RUNNING
            self.running.append(seq)
            seqs.append(seq)
            num_new.append(chunk)
            budget -= chunk
        return ScheduledBatch(seqs, num_new)
