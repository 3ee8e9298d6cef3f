"""The n-gram table drafter, method "ngram_table" (akunu's predictor; vLLM's "ngram" is our "prompt_lookup"):
frequency tables of orders 2..4 over a sliding window, chained predictions.

Per request, tables map a context of ``order - 1`` tokens to continuation counts. Prediction tries the longest
context first and takes its most frequent continuation (ties: the most recently seen wins), appends it to the
context and repeats, up to k tokens. Tables are seeded from the prompt and updated with every *emitted* token
(the engine's output after stop truncation) - never with rejected drafts, which never reach the output. Tokens
leaving the window (512 by default) take their n-grams with them: counts are decremented, so the tables describe
exactly the window. No prediction means no drafts: the request takes a plain decode step with no verification.

Tree mode (``propose_tree``): the same tables drive a best-first expansion. A node's candidate children are the
continuations of its context (the longest order that has one, as for the chain), each with the estimated path
probability ``parent's * count / total``; the budget keeps the most probable nodes (after the chain itself, kept
whenever the budget holds it), siblings most probable first (ties: the most recently seen).
"""

from __future__ import annotations

import heapq
from collections import deque

from specdec.spec_decode.proposers.base import DraftProposal, ModelFreeProposer
from specdec.spec_decode.proposers.token_trie import best_first_tree, check_tree_budgets, tree_proposal
from specdec.spec_decode.request import RequestView
from specdec.spec_decode.tree import DraftTree


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
        context = self._tail(self.max_order - 1)
        out: list[int] = []
        while len(out) < k:
            token = self._next(context)
            if token is None:
                break
            out.append(token)
            context = (context + [token])[-(self.max_order - 1):]
        return out

    def predict_tree(self, max_depth: int, max_nodes: int, keep_chain: bool = True) -> DraftTree:
        """A tree of table predictions after the current history: root = the last token pushed, depth
        ``<= max_depth``, at most ``max_nodes`` drafts, the most probable paths kept (module docstring);
        ``predict(max_depth)`` is a root-to-node path whenever ``max_nodes`` holds it, unless ``keep_chain`` is
        False (then the budget goes to the most probable nodes only)."""
        if not self.history:
            raise ValueError("predict_tree needs a history: its root is the last token pushed")
        root = self.history[-1]
        if max_depth <= 0 or max_nodes <= 0:
            return DraftTree((root,), (-1,))
        keep = self.max_order - 1

        def expand(state: tuple[tuple[int, ...], float]) -> list[tuple[int, tuple, tuple]]:
            context, prob = state
            conts = self._continuations(list(context))
            if not conts:
                return []
            total = sum(count for count, _ in conts.values())
            # the best max_nodes continuations (no node keeps more children), best first: count, then last seen
            # (sibling last-seen indices differ: a total order, whose first is the chain's _next)
            best = heapq.nsmallest(max_nodes, conts.items(), key=lambda kv: (-kv[1][0], -kv[1][1]))
            return [(tok, (-prob * count / total, -last), ((*context, tok)[-keep:], prob * count / total))
                    for tok, (count, last) in best]

        context = tuple(self._tail(keep))
        chain = self.predict(max_depth) if keep_chain else ()
        return best_first_tree(root, (context, 1.0), expand, max_depth, max_nodes, chain)

    def _tail(self, n: int) -> list[int]:
        """The last ``n`` tokens of the history (O(n): a deque indexes its ends in O(1), no copy of the window)."""
        hist = self.history
        return [hist[i] for i in range(max(0, len(hist) - n), len(hist))]

    def _continuations(self, context: list[int]) -> dict[int, list[int]] | None:
        """Continuation -> [count, last seen] of the longest order whose context matches, or None."""
        for n in range(self.max_order, self.min_order - 1, -1):
            if len(context) < n - 1:
                continue
            conts = self.tables[n].get(tuple(context[len(context) - (n - 1):]))
            if conts:
                return conts
        return None

    def _next(self, context: list[int]) -> int | None:
        conts = self._continuations(context)
        if not conts:
            return None
        # most frequent; ties broken by the most recent occurrence
        return max(conts.items(), key=lambda kv: (kv[1][0], kv[1][1]))[0]


class NgramTableProposer(ModelFreeProposer):
    """Model-free drafter over :class:`NgramTable` per request; drafts are one-hot (q is a point mass)."""

    def __init__(self, min_order: int = 2, max_order: int = 4, window: int = 512, keep_chain: bool = True):
        self.min_order, self.max_order, self.window = min_order, max_order, window
        self.keep_chain = keep_chain  # trees keep propose()'s chain first (NgramTable.predict_tree)
        self.tables: dict[int, NgramTable] = {}

    def propose(self, seqs: list[RequestView], num_tokens: list[int]) -> DraftProposal:
        drafts = [self._table(seq).predict(k) if k > 0 else [] for seq, k in zip(seqs, num_tokens)]
        return DraftProposal(drafts, None, [True] * len(seqs))

    def propose_tree(self, seqs: list[RequestView], max_depths: list[int], max_nodes: list[int]) -> DraftProposal:
        """Per request a tree of table predictions (depth ``<= max_depths[i]``, ``<= max_nodes[i]`` drafts);
        one-hot, no q."""
        check_tree_budgets(len(seqs), max_depths, max_nodes)
        return tree_proposal([self._table(seq).predict_tree(d, n, self.keep_chain)
                              for seq, d, n in zip(seqs, max_depths, max_nodes)])

    def _table(self, seq: RequestView) -> NgramTable:
        """The request's table, caught up with its emitted tokens."""
        table = self.tables.get(seq.seq_id)
        if table is None:
            table = self.tables[seq.seq_id] = NgramTable(self.min_order, self.max_order, self.window)
        for token in seq.all_token_ids[table.num_pushed :]:  # only emitted tokens ever reach the stream
            table.push(token)
        return table

    def free(self, seq_id: int, finished: bool) -> None:
        # keep the table across preemption: the request's tokens are kept, so its stream is still valid
        if finished:
            self.tables.pop(seq_id, None)
