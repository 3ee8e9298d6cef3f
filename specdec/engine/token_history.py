"""A request's token history (prompt + output), kept incrementally.

The engine appends a few tokens per step to a history that may be thousands long; everything that reads the
history every step (prompt-lookup drafting, n-gram tables, repetition / presence / frequency penalties) must cost
O(new tokens), not O(length). :class:`TokenHistory` holds, updated on every :meth:`TokenHistory.append`:

- the prompt, the output and the whole history as read-only lists (``prompt``, ``output``, ``tokens``) and the
  history as a growing int64 buffer (``array``, amortised O(1) append: the buffer doubles when full);
- the **distinct** tokens seen so far with their output counts (:meth:`TokenHistory.penalty_counts`): what the
  penalties need, O(distinct) to hand over instead of O(length) to recount.

Appending is the only way the history changes: the lists it hands out refuse in-place changes.
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np


class TokenHistory:
    """prompt + output token ids of one request: read-only lists, an int64 buffer, and distinct-token counts."""

    def __init__(self, prompt: Iterable[int]):
        prompt = list(prompt)
        self.num_prompt = len(prompt)
        self._buf = np.empty(max(64, 2 * len(prompt)), dtype=np.int64)  # [capacity]; [:size] is the history
        self._buf[: len(prompt)] = prompt
        self._size = len(prompt)
        self._prompt = ReadOnlyTokens(prompt)
        self._output = ReadOnlyTokens()
        self._tokens = ReadOnlyTokens(prompt)
        # distinct tokens: ids[:nd] (int64), their output counts counts[:nd] (int32; 0 = prompt only)
        ids = np.unique(self._buf[: self._size])  # [D] sorted
        capacity = max(64, 2 * ids.size)
        self._ids = np.empty(capacity, dtype=np.int64)
        self._counts = np.zeros(capacity, dtype=np.int32)
        self._ids[: ids.size] = ids
        self._nd = ids.size
        self._slot = dict(zip(ids.tolist(), range(ids.size)))  # token id -> its index in ids

    # -- growth ---------------------------------------------------------------------------------------------
    def append(self, token: int) -> None:
        """One output token: O(1) amortised."""
        if self._size == self._buf.size:
            self._buf = _grown(self._buf, self._size)
        self._buf[self._size] = token
        self._size += 1
        list.append(self._output, token)
        list.append(self._tokens, token)
        slot = self._slot.get(token)
        if slot is None:
            if self._nd == self._ids.size:
                self._ids, self._counts = _grown(self._ids, self._nd), _grown(self._counts, self._nd, zero=True)
            slot = self._slot[token] = self._nd
            self._ids[slot] = token
            self._nd += 1
        self._counts[slot] += 1

    def extend(self, tokens: Iterable[int]) -> None:
        for token in tokens:
            self.append(token)

    # -- views (read-only; they grow with the history) ------------------------------------------------------
    @property
    def prompt(self) -> list[int]:
        return self._prompt

    @property
    def output(self) -> list[int]:
        return self._output

    @property
    def tokens(self) -> list[int]:
        """prompt + output (O(1): the same list object grows with the history)."""
        return self._tokens

    @property
    def array(self) -> np.ndarray:
        """prompt + output, int64 ``[L]`` (a read-only view of the buffer, valid until the next append)."""
        return _readonly(self._buf[: self._size])

    @property
    def output_array(self) -> np.ndarray:
        """output only, int64 ``[L - num_prompt]``."""
        return _readonly(self._buf[self.num_prompt : self._size])

    def __len__(self) -> int:
        return self._size

    @property
    def num_output(self) -> int:
        return self._size - self.num_prompt

    def penalty_counts(self, extra: Iterable[int] = ()) -> tuple[np.ndarray, np.ndarray]:
        """``(ids int64 [D], counts int32 [D])``: each distinct token of prompt + output + ``extra`` once, with its
        count in output + ``extra`` (0 for tokens seen in the prompt only). O(D) to copy at most; without
        ``extra`` the arrays are read-only views (no copy)."""
        ids, counts = self._ids[: self._nd], self._counts[: self._nd]
        extra = list(extra)
        if not extra:
            return _readonly(ids), _readonly(counts)
        counts = counts.copy()
        new: dict[int, int] = {}  # extra tokens the history has not seen -> their count
        for token in extra:
            slot = self._slot.get(token)
            if slot is None:
                new[token] = new.get(token, 0) + 1
            else:
                counts[slot] += 1
        if new:
            ids = np.concatenate([ids, np.fromiter(new.keys(), dtype=np.int64, count=len(new))])
            counts = np.concatenate([counts, np.fromiter(new.values(), dtype=np.int32, count=len(new))])
        return ids, counts


def _grown(buf: np.ndarray, used: int, zero: bool = False) -> np.ndarray:
    """``buf`` with twice the capacity, its first ``used`` entries kept."""
    out = (np.zeros if zero else np.empty)(2 * buf.size, dtype=buf.dtype)
    out[:used] = buf[:used]
    return out


def _readonly(view: np.ndarray) -> np.ndarray:
    view.flags.writeable = False
    return view


class ReadOnlyTokens(list):
    """A list of token ids that only its :class:`TokenHistory` extends: readable like any list, refusing every
    in-place change (copy it with ``list()`` to get a list of your own)."""

    __slots__ = ()

    def _refuse(self, *args, **kwargs):
        raise TypeError("a request's token lists are read-only (they grow with the request: "
                        "Sequence.append_token); copy one with list() to get a list of your own")

    append = extend = insert = pop = remove = clear = sort = reverse = _refuse
    __setitem__ = __delitem__ = __iadd__ = __imul__ = _refuse

    def __reduce__(self):  # copy / pickle: a plain list
        return list, (list(self),)
