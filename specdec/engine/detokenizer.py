"""Incremental detokenisation and stop-string handling.

Streaming never shows partial UTF-8 (a trailing U+FFFD means the last token ended mid-character) and holds
back any suffix that could still begin a stop string. When a stop string appears, the text is cut before
it; ``token_ids`` keep the token that completed it.
"""

from __future__ import annotations

from specdec.engine.sequence import Sequence
from specdec.tokenizer.tokenizer import Tokenizer


def append_text(seq: Sequence, tokenizer: Tokenizer) -> bool:
    """Decode the tokens added since the last call into ``seq.output_text``; True if a stop string ended it.

    Uses vLLM's prefix/read offsets: decode a short window both with and without the new tokens and append
    the difference, so the cost per token does not grow with the output length.
    """
    ids = seq.output_token_ids
    prefix = tokenizer.decode(ids[seq.prefix_offset : seq.read_offset])
    full = tokenizer.decode(ids[seq.prefix_offset :])
    if len(full) > len(prefix) and not full.endswith("\ufffd"):
        seq.output_text += full[len(prefix) :]
        seq.prefix_offset = seq.read_offset
        seq.read_offset = len(ids)
    stops = seq.params.stop_strings
    if stops:
        # search only the region the new text could complete a stop string in
        start = max(0, seq.stable_text_len - max(len(s) for s in stops))
        hits = [(seq.output_text.find(s, start), s) for s in stops]
        hits = [(i, s) for i, s in hits if i >= 0]
        if hits:
            cut = min(i for i, _ in hits)
            seq.output_text = seq.output_text[:cut]
            seq.stable_text_len = cut
            return True
    seq.stable_text_len = len(seq.output_text) - _held_back(seq.output_text, stops)
    return False


def finalize_text(seq: Sequence, tokenizer: Tokenizer, stopped_by_string: bool) -> None:
    """On finish, show everything: the text cut at the stop string, or the full decode of the output."""
    if not stopped_by_string:
        seq.output_text = tokenizer.decode(seq.output_token_ids)
    seq.stable_text_len = len(seq.output_text)


def _held_back(text: str, stops: tuple[str, ...]) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of some stop string."""
    best = 0
    for s in stops:
        for n in range(min(len(s) - 1, len(text)), best, -1):
            if text.endswith(s[:n]):
                best = n
                break
    return best
