"""Continuous-batching scheduler with recompute preemption.

Each step: running sequences keep going (decode, or the next prefill chunk), then waiting ones are admitted
while the pool fits their prompt plus lookahead, up to ``max_num_seqs`` and the token budget. When the pool
runs short, the newest running request is preempted - its blocks freed, its tokens kept - and recomputed
later. Randomness depends on (seed, position) only, so a preempted request resumes with the same draws.
The oldest request can always progress because the pool holds at least one full-length sequence, so a valid
request never fails for lack of blocks.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from specdec.cache.block_manager import BlockManager
from specdec.engine.sequence import Sequence, Status


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
        # Several pools (target, draft) are allocated in lockstep: a block decision holds for all of them.
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
        for bm in self.block_managers:
            bm.free(seq.seq_id)
        for hook in self.on_free:
            hook(seq)

    # --- block helpers -------------------------------------------------------------------------------------
    def _can_reserve(self, seq: Sequence, target_len: int) -> bool:
        for bm in self.block_managers:
            current = bm.seq_len(seq.seq_id) if bm.has_seq(seq.seq_id) else 0
            if target_len > current and not (
                bm.can_append(seq.seq_id, target_len - current) if bm.has_seq(seq.seq_id)
                else bm.can_allocate(target_len)
            ):
                return False
        return True

    def _reserve(self, seq: Sequence, target_len: int) -> None:
        for bm in self.block_managers:
            if not bm.has_seq(seq.seq_id):
                bm.allocate(seq.seq_id, target_len)
            elif target_len > bm.seq_len(seq.seq_id):
                bm.append_slots(seq.seq_id, target_len - bm.seq_len(seq.seq_id))

    def _grant(self, seq: Sequence, base: int, desired: int) -> int | None:
        """The largest lookahead in [0, desired] whose slots the pools can reserve, or None."""
        for lookahead in range(desired, -1, -1):
            if self._can_reserve(seq, base + lookahead):
                return lookahead
        return None

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
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
        # 1. running sequences, oldest first; preempt the newest when the pool runs short.
        for seq in sorted(self.running, key=lambda s: s.seq_id):
            if seq not in self.running:  # preempted in this loop
                continue
            remaining = seq.num_tokens - seq.num_computed
            chunk = min(remaining, budget) if remaining > 1 else remaining
            if chunk <= 0:
                continue
            base = seq.num_computed + chunk
            desired = self.lookahead(seq) if chunk == remaining else 0
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
            remaining = seq.num_tokens - seq.num_computed
            chunk = min(remaining, budget)
            # Reserve the whole prompt (+ lookahead) up front so later chunks never need new blocks.
            lookahead = self.lookahead(seq)
            if not self._can_reserve(seq, seq.num_tokens + lookahead):
                break
            self.waiting.popleft()
            self._reserve(seq, seq.num_tokens + lookahead)
            seq.lookahead = lookahead if chunk == remaining else 0
            seq.status = Status.RUNNING
            self.running.append(seq)
            seqs.append(seq)
            num_new.append(chunk)
            budget -= chunk
        return ScheduledBatch(seqs, num_new)
