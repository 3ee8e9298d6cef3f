"""A request checked before it is queued: every problem a ``ValueError`` that says what is wrong and what is
allowed, and no state changed."""

from __future__ import annotations

from specdec.sampling.params import SamplingParams
from specdec.tokenizer.tokenizer import Tokenizer


def validate_request(prompt: str | None, prompt_token_ids: list[int] | None, params: SamplingParams,
                     tokenizer: Tokenizer | None, vocab_size: int, max_model_len: int) -> list[int]:
    """The request's prompt token ids (``prompt`` encoded when no ids are given), or ``ValueError``."""
    if not isinstance(params, SamplingParams):
        raise ValueError(f"sampling_params must be a SamplingParams, got {type(params).__name__}")
    params.__post_init__()  # again: a field may have been changed since construction
    if prompt_token_ids is None:
        if not isinstance(prompt, str):
            raise ValueError(f"prompt must be a string, got {type(prompt).__name__}")
        if tokenizer is None:
            raise ValueError("this model folder has no tokenizer.json: pass prompt_token_ids instead of text")
        prompt_token_ids = tokenizer.encode(prompt)
    if not isinstance(prompt_token_ids, (list, tuple)) or not all(
        isinstance(t, int) and not isinstance(t, bool) for t in prompt_token_ids
    ):
        raise ValueError("prompt_token_ids must be a list of ints")
    if len(prompt_token_ids) == 0:
        raise ValueError("the prompt is empty; give at least one token")
    bad = [t for t in prompt_token_ids if not 0 <= t < vocab_size]
    if bad:
        raise ValueError(f"prompt token ids {bad[:5]} are outside the vocabulary [0, {vocab_size})")
    total = len(prompt_token_ids) + params.max_tokens
    if total > max_model_len:
        raise ValueError(
            f"prompt ({len(prompt_token_ids)} tokens) + max_tokens ({params.max_tokens}) = {total} exceeds "
            f"max_model_len={max_model_len}; shorten the prompt or lower max_tokens"
        )
    return list(prompt_token_ids)
