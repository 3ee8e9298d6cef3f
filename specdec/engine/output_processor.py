"""Output processing: a step's tokens appended to a request one by one with stop checks, and the outputs reported.

Stop conditions are checked after every token, on accepted tokens only (a verification round's tokens arrive
together; the ones after a stop are dropped): EOS, ``stop_token_ids``, stop strings (engine/detokenizer.py), a
structured output's grammar complete, ``max_tokens``.
"""

from __future__ import annotations

import time

from specdec.engine.detokenizer import append_text
from specdec.engine.sequence import Sequence
from specdec.outputs import CompletionOutput, RequestOutput
from specdec.sampling.logprobs import TokenLogprobs
from specdec.tokenizer.tokenizer import Tokenizer


def append_tokens(seq: Sequence, tokens: list[int], logprobs: list[TokenLogprobs] | None,
                  tokenizer: Tokenizer | None) -> tuple[str | None, bool]:
    """Append ``tokens`` (with their logprobs, when kept) to ``seq`` one by one, detokenising, until a stop
    condition holds. Returns ``(finish reason or None, whether a stop string ended it)``; the tokens after the
    stop are dropped."""
    if seq.logprobs is not None and (logprobs is None or len(logprobs) != len(tokens)):
        raise RuntimeError(f"the step computed {0 if logprobs is None else len(logprobs)} logprobs for "
                           f"{len(tokens)} tokens")
    m = seq.metrics
    if m.first_token_time is None:
        m.first_token_time = time.perf_counter()
    for i, token in enumerate(tokens):
        seq.append_token(token)
        if seq.logprobs is not None:  # kept aligned with output_token_ids: tokens after a stop are dropped
            seq.logprobs.append(logprobs[i])
            seq.cumulative_logprob += logprobs[i][token]
        stopped_by_string = tokenizer is not None and append_text(seq, tokenizer)
        reason = finish_reason(seq, token, stopped_by_string)
        if reason is not None:
            m.num_generated_tokens = len(seq.output_token_ids)
            return reason, stopped_by_string
    m.num_generated_tokens = len(seq.output_token_ids)
    return None, False


def finish_reason(seq: Sequence, token: int, stopped_by_string: bool) -> str | None:
    """"stop" (EOS, a stop id, a stop string, or a structured output's grammar complete), "length" (``max_tokens``
    reached) or None after ``token``."""
    if stopped_by_string or token in seq.eos_token_ids or token in seq.params.stop_token_ids:
        return "stop"
    if seq.grammar is not None and seq.grammar.finished:
        return "stop"
    if len(seq.output_token_ids) >= seq.params.max_tokens:
        return "length"
    return None


def request_output(seq: Sequence) -> RequestOutput:
    """The cumulative output of a request with one sample (vLLM's shape)."""
    return RequestOutput(
        request_id=seq.request_id,
        prompt=seq.prompt,
        prompt_token_ids=seq.prompt_token_ids,  # read-only: shared, not copied
        outputs=[completion(seq)],
        finished=seq.is_finished,
        metrics=seq.metrics.as_dict(),
        error=seq.error,
    )


def completion(seq: Sequence) -> CompletionOutput:
    """One sample's text (as far as streaming may show it), tokens, finish reason and logprobs."""
    logprobs = None if seq.logprobs is None else list(seq.logprobs)
    return CompletionOutput(seq.index, seq.output_text[: seq.stable_text_len], list(seq.output_token_ids),
                            seq.finish_reason, logprobs, None if logprobs is None else seq.cumulative_logprob)
