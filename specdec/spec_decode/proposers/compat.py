"""Can this draft propose tokens for this target? Same token -> id map, same eos; a vocab no larger."""

from __future__ import annotations

from specdec.model.config import ModelConfig
from specdec.tokenizer.tokenizer import Tokenizer


def check_draft_compatible(
    target: ModelConfig, draft: ModelConfig, target_tok: Tokenizer | None, draft_tok: Tokenizer | None,
    target_eos: tuple[int, ...], draft_eos: tuple[int, ...],
) -> None:
    """Raise ``ValueError`` naming the first difference between target and draft vocabularies."""
    if draft.vocab_size > target.vocab_size:
        raise ValueError(f"the draft's vocab_size ({draft.vocab_size}) is larger than the target's "
                         f"({target.vocab_size}); a draft must share the target's vocabulary")
    if target_tok is not None and draft_tok is not None:
        t_vocab, d_vocab = target_tok.get_vocab(), draft_tok.get_vocab()
        for token, tid in sorted(d_vocab.items(), key=lambda kv: kv[1]):
            if t_vocab.get(token) != tid:
                raise ValueError(f"tokenizers differ: draft token {token!r} has id {tid}, the target's "
                                 f"{'has id ' + str(t_vocab[token]) if token in t_vocab else 'has no such token'}")
        missing = set(t_vocab) - set(d_vocab)
        first = min(missing, key=lambda t: t_vocab[t]) if missing else None
        if first is not None and t_vocab[first] < draft.vocab_size:
            raise ValueError(f"tokenizers differ: target token {first!r} (id {t_vocab[first]}) is not in the draft's")
    elif target.bos_token_id != draft.bos_token_id:
        raise ValueError(f"bos ids differ: target {target.bos_token_id}, draft {draft.bos_token_id}")
    if set(target_eos) != set(draft_eos):
        raise ValueError(f"eos ids differ: target {sorted(target_eos)}, draft {sorted(draft_eos)}")
