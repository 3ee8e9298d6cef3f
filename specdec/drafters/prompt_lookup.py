"""Prompt-lookup drafter: copy what followed the latest earlier occurrence of the text's own suffix.

For n from ``max_ngram`` down to ``min_ngram``: find the most recent earlier occurrence (never the suffix itself)
of the last n tokens of prompt + output, and propose the up-to-k tokens that followed it. Longer matches are
preferred. (vLLM calls this method "ngram"; here "ngram" is the frequency-table predictor in ngram.py.)
"""

from __future__ import annotations

import numpy as np

from specdec.drafters.base import DraftProposal
from specdec.engine.sequence import Sequence


def prompt_lookup(tokens: list[int], k: int, min_ngram: int, max_ngram: int) -> list[int]:
    """Up to ``k`` tokens that followed the most recent earlier match of the longest matching suffix."""
    length = len(tokens)
    if k <= 0 or length < min_ngram + 1:
        return []
    arr = np.asarray(tokens, dtype=np.int64)
    for n in range(min(max_ngram, length - 1), min_ngram - 1, -1):
        suffix = arr[length - n :]
        # windows starting at 0 .. length - n - 1: every occurrence except the suffix itself
        windows = np.lib.stride_tricks.sliding_window_view(arr[: length - 1], n)
        hits = np.flatnonzero((windows == suffix).all(axis=1))
        if hits.size:
            start = int(hits[-1]) + n  # most recent match first
            return tokens[start : start + k]
    return []


class PromptLookupDrafter:
    def __init__(self, min_ngram: int = 2, max_ngram: int = 4):
        self.min_ngram, self.max_ngram = min_ngram, max_ngram

    def propose(self, seqs: list[Sequence], num_tokens: list[int]) -> DraftProposal:
        drafts = [prompt_lookup(s.all_token_ids, k, self.min_ngram, self.max_ngram) for s, k in zip(seqs, num_tokens)]
        return DraftProposal(drafts, None, [True] * len(seqs))

    def rollback(self, seq: Sequence, kv_len: int) -> None:
        pass

    def free(self, seq: Sequence) -> None:
        pass
