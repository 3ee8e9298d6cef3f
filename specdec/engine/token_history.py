"""A request's token history (prompt + output), kept incrementally.

The engine appends a few tokens per step to a history that may be thousands long; everything that reads the
history every step (prompt-lookup drafting, n-gram tables, repetition / presence / frequency penalties) must cost
O(new tokens), not O(length). :class:`TokenHistory` holds, updated on every append:

- the whole history as a read-only list (``tokens``) and as a growing int64 buffer (``array``, amortised O(1)
  append: the buffer doubles when full);
- the **distinct** tokens seen so far with their output counts (``penalty_counts``): what the penalties need,
  O(distinct) to hand over instead of O(length) to rebuild.

``Sequence.prompt_token_ids`` / ``output_token_ids`` are :class:`TokenList` s: ordinary lists that forward
appends to their history, and rebuild it (O(length), once) on any other in-place change (truncation, item
assignment, ...). ``out + drafts`` gives a :class:`DerivedTokens`: a plain list that remembers it is the
history's output followed by a few extra tokens, so that the penalty context of a draft position is the
history's counts plus the extras.
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np


class TokenHistory:
    """prompt + output token ids of one request: a read-only list, an int64 buffer, and distinct-token counts."""

    def __init__(self, prompt: Iterable[int], output: Iterable[int] = ()):
        self.reset(prompt, output)

    def reset(self, prompt: Iterable[int], output: Iterable[int] = ()) -> None:
        """Rebuild everything from ``prompt`` and ``output`` (O(length); appends never need this)."""
        prompt, output = list(prompt), list(output)
        self.num_prompt = len(prompt)
        self.version = getattr(self, "version", -1) + 1  # bumped by every rebuild: derived lists compare it
        size = len(prompt) + len(output)
        self._buf = np.empty(max(64, 2 * size), dtype=np.int64)  # [capacity]; [:size] is the history
        self._buf[:size] = prompt + output
        self._size = size
        self._list = ReadOnlyTokens(prompt + output)
        # distinct tokens: ids[:nd] (int64), their output counts counts[:nd] (int32; 0 = prompt only)
        ids = np.unique(self._buf[:size])  # [D] sorted
        counts = np.zeros(ids.size, dtype=np.int32)
        if output:
            np.add.at(counts, np.searchsorted(ids, self._buf[self.num_prompt : size]), 1)
        capacity = max(64, 2 * ids.size)
        self._ids = np.empty(capacity, dtype=np.int64)
        self._counts = np.zeros(capacity, dtype=np.int32)
        self._ids[: ids.size], self._counts[: ids.size] = ids, counts
        self._nd = ids.size
        self._slot = dict(zip(ids.tolist(), range(ids.size)))  # token id -> its index in ids

    # -- growth ---------------------------------------------------------------------------------------------
    def append(self, token: int) -> None:
        """One output token: O(1) amortised."""
        if self._size == self._buf.size:
            self._buf = _grown(self._buf, self._size)
        self._buf[self._size] = token
        self._size += 1
        list.append(self._list, token)
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

    # -- views (read-only; they stay valid until the next append or rebuild) --------------------------------
    @property
    def tokens(self) -> list[int]:
        """prompt + output as a read-only list (O(1): the same list object grows with the history)."""
        return self._list

    @property
    def array(self) -> np.ndarray:
        """prompt + output, int64 ``[L]`` (a read-only view of the buffer)."""
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
    """The history's list of tokens: readable like any list, mutable only by its :class:`TokenHistory`."""

    __slots__ = ()

    def _refuse(self, *args, **kwargs):
        raise TypeError("Sequence.all_token_ids is read-only (it grows with the sequence); copy it with list() "
                        "to get a list of your own")

    append = extend = insert = pop = remove = clear = sort = reverse = _refuse
    __setitem__ = __delitem__ = __iadd__ = __imul__ = _refuse

    def __reduce__(self):  # copy / pickle: a plain list
        return list, (list(self),)


class TokenList(list):
    """A request's prompt or output list: a list that keeps its :class:`TokenHistory` in step.

    ``append`` / ``extend`` / ``+=`` on the output are forwarded to the history (O(new tokens)); any other in-place
    change, and any change to the prompt, rebuilds the history from both lists (O(length))."""

    __slots__ = ("history", "is_output")  # history: None once the sequence was given another list

    def __init__(self, tokens: Iterable[int], history: TokenHistory, is_output: bool):
        super().__init__(tokens)
        self.history = history
        self.is_output = is_output

    def append(self, token: int) -> None:
        list.append(self, token)
        if self.is_output and self.history is not None:
            self.history.append(token)
        else:
            self._resync()

    def extend(self, tokens: Iterable[int]) -> None:
        tokens = list(tokens)
        list.extend(self, tokens)
        if self.is_output and self.history is not None:
            self.history.extend(tokens)
        else:
            self._resync()

    def __iadd__(self, tokens: Iterable[int]) -> TokenList:
        self.extend(tokens)
        return self

    def __add__(self, other: list) -> list:
        """``output + drafts``: a :class:`DerivedTokens` (a plain list otherwise)."""
        joined = list.__add__(self, other)
        if not self.is_output or self.history is None:
            return joined
        return DerivedTokens(joined, self.history, len(self))

    def penalty_source(self) -> tuple[TokenHistory, list[int]] | None:
        """``(history, no extra tokens)`` for an output list (its penalty counts are the history's), else None."""
        return (self.history, []) if self.is_output and self.history is not None else None

    def __reduce__(self):  # copy / pickle: a plain list (the history belongs to the sequence)
        return list, (list(self),)

    def _resync(self) -> None:
        """Rebuild the history after an in-place change other than an output append."""
        h = self.history
        if h is None:  # detached: the sequence was given another list; this one is a plain list now
            return
        if self.is_output:
            h.reset(h.tokens[: h.num_prompt], self)
        else:
            h.reset(self, h.tokens[h.num_prompt :])


def _changing(name: str):
    base = getattr(list, name)

    def method(self, *args, **kwargs):
        result = base(self, *args, **kwargs)
        self._resync()
        return self if name == "__imul__" else result

    method.__name__ = name
    return method


for _name in ("insert", "pop", "remove", "clear", "sort", "reverse", "__setitem__", "__delitem__", "__imul__"):
    setattr(TokenList, _name, _changing(_name))


class DerivedTokens(list):
    """``output + extra`` (a plain list to every reader) that remembers which history's output it starts with:
    ``penalty_source`` then takes the history's counts plus ``extra`` instead of recounting the whole list."""

    __slots__ = ("history", "base_len", "version")

    def __init__(self, tokens: list[int], history: TokenHistory, base_len: int):
        super().__init__(tokens)
        self.history, self.base_len, self.version = history, base_len, history.version

    def __reduce__(self):
        return list, (list(self),)

    def penalty_source(self) -> tuple[TokenHistory, list[int]] | None:
        """``(history, extra tokens)`` if this list is still exactly the history's output + extras, else None."""
        h = self.history
        if h is None or h.version != self.version or h.num_output != self.base_len or len(self) < self.base_len:
            return None
        return h, list.__getitem__(self, slice(self.base_len, None))


def _forgetting(name: str):
    base = getattr(list, name)

    def method(self, *args, **kwargs):
        self.history = None  # changed in place: no longer known to be output + extras
        result = base(self, *args, **kwargs)
        return self if name in ("__iadd__", "__imul__") else result

    method.__name__ = name
    return method


for _name in ("append", "extend", "insert", "pop", "remove", "clear", "sort", "reverse", "__setitem__",
              "__delitem__", "__iadd__", "__imul__"):
    setattr(DerivedTokens, _name, _forgetting(_name))
