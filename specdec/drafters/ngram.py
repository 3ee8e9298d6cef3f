"""N-gram drafter (akunu's predictor): frequency tables of orders 2..4 over a sliding window, chained predictions.

Per request, tables map a context of ``order - 1`` tokens to continuation counts. Prediction tries the longest
context first and takes its most frequent continuation (ties: the most recently seen wins), appends it to the
context and repeats, up to k tokens. Tables are seeded from the prompt and updated with every *emitted* token
(the engine's output after stop truncation) - never with rejected drafts, which never reach the output. Tokens
leaving the window (512 by default) take their n-grams with them: counts are decremented, so the tables describe
exactly the window. No prediction means no drafts: the request takes a plain decode step with no verification.
"""

from __future__ import annotations

from collections import deque

from specdec.drafters.base import DraftProposal
from specdec.engine.sequence import Sequence


class NgramTable:
    """Sliding-window n-gram counts of one token stream."""

    def __init__(self, min_order: int = 2, max_order: int = 4, window: int = 512):
        assert 2 <= min_order <= max_order, "orders must satisfy 2 <= min_order <= max_order"
        assert window >= max_order, "the window must hold at least one n-gram of the highest order"
        self.min_order, self.max_order, self.window = min_order, max_order, window
        self.history: deque[int] = deque()
        self.num_pushed = 0  # tokens of the stream consumed so far (the stream index of the next token)
        # order -> context tuple -> continuation -> [count, stream index of its most recent occurrence]
        self.tables: dict[int, dict[tuple[int, ...], dict[int, list[int]]]] = {
            n: {} for n in range(min_order, max_order + 1)
        }

    def push(self, token: int) -> None:
        self.history.append(token)
        hist = self.history
        for n in self.tables:
            if len(hist) >= n:
                ctx = tuple(hist[i] for i in range(len(hist) - n, len(hist) - 1))
                entry = self.tables[n].setdefault(ctx, {}).setdefault(token, [0, 0])
                entry[0] += 1
                entry[1] = self.num_pushed
        self.num_pushed += 1
        if len(hist) > self.window:
            self._evict_oldest()

    def _evict_oldest(self) -> None:
        hist = self.history
        for n, table in self.tables.items():
            ctx = tuple(hist[i] for i in range(n - 1))
            token = hist[n - 1]
            conts = table[ctx]
            conts[token][0] -= 1
            if conts[token][0] == 0:
                del conts[token]
                if not conts:
                    del table[ctx]
        hist.popleft()

    def predict(self, k: int) -> list[int]:
        """Up to ``k`` chained predictions after the current history."""
        context = list(self.history)[-(self.max_order - 1):]
        out: list[int] = []
        while len(out) < k:
            token = self._next(context)
            if token is None:
                break
            out.append(token)
            context = (context + [token])[-(self.max_order - 1):]
        return out

    def _next(self, context: list[int]) -> int | None:
        for n in range(self.max_order, self.min_order - 1, -1):
            if len(context) < n - 1:
                continue
            conts = self.tables[n].get(tuple(context[len(context) - (n - 1):]))
            if conts:
                # most frequent; ties broken by the most recent occurrence
                return max(conts.items(), key=lambda kv: (kv[1][0], kv[1][1]))[0]
        return None


class NgramDrafter:
    """Model-free drafter over :class:`NgramTable` per request; drafts are one-hot (q is a point mass)."""

    def __init__(self, min_order: int = 2, max_order: int = 4, window: int = 512):
        self.min_order, self.max_order, self.window = min_order, max_order, window
        self.tables: dict[int, NgramTable] = {}

    def propose(self, seqs: list[Sequence], num_tokens: list[int]) -> DraftProposal:
        drafts = []
        for seq, k in zip(seqs, num_tokens):
            table = self.tables.get(seq.seq_id)
            if table is None:
                table = self.tables[seq.seq_id] = NgramTable(self.min_order, self.max_order, self.window)
            tokens = seq.all_token_ids
            for token in tokens[table.num_pushed :]:  # only emitted tokens ever reach the stream
                table.push(token)
            drafts.append(table.predict(k) if k > 0 else [])
        return DraftProposal(drafts, None, [True] * len(seqs))

    def rollback(self, seq: Sequence, kv_len: int) -> None:
        pass  # the tables only ever saw emitted tokens

    def free(self, seq: Sequence) -> None:
        # keep the table across preemption: the request's tokens are kept, so its stream is still valid
        if seq.is_finished:
            self.tables.pop(seq.seq_id, None)
