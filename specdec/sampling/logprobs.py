"""Log-probabilities of emitted tokens, from the target's raw logits (vLLM's default ``logprobs_mode``).

A token's log-probability is ``log_softmax(z)[token]`` with ``z`` the target's fp32 logits row the token was drawn
from - **before** penalties, temperature and top-k / top-p / min-p filtering (vLLM's "raw_logprobs"; the
definition and its consequences are in docs/metrics.md). Speculation does not change the row: a verification
window's row j is the target's logits for the same context as a plain step's, so speculation on and off give the
same numbers for the same tokens, up to the forward's floating-point batch-shape differences.
"""

from __future__ import annotations

import torch

from specdec.device import to_device

TokenLogprobs = dict[int, float]  # token id -> log-probability: the top-N tokens, then the emitted one


def token_logprobs(logits: torch.Tensor, rows: list[int], tokens: list[int], top_n: list[int]) -> list[TokenLogprobs]:
    """One dict per emitted token; ``log_softmax`` is computed for the listed rows only, and the results come
    to the host in one read.

    Args:
        logits: fp32 ``[R, V]`` target logits (raw: no penalties, temperature or filtering applied).
        rows: per emitted token, the row of ``logits`` it was drawn from (a row may repeat).
        tokens: the emitted token ids, ``len(rows)`` of them.
        top_n: per emitted token, how many of the most likely tokens to add (0 = the emitted token only).

    Returns:
        Per token, a dict whose first ``top_n`` entries are the most likely tokens in descending order (ties in
        ``torch.topk``'s order), followed by the emitted token when it is not among them.
    """
    if not rows:
        return []
    device = logits.device
    lp = torch.log_softmax(logits[to_device(rows, torch.int64, device)].float(), dim=-1)  # (N, V) fp32
    chosen = lp.gather(1, to_device(tokens, torch.int64, device)[:, None])  # (N, 1)
    k = max(top_n)
    top = lp.topk(k, dim=-1) if k else None  # values / indices (N, k)
    parts = [chosen.double()] + ([top.values.double(), top.indices.double()] if top is not None else [])
    host = torch.cat(parts, dim=1).tolist()  # the one host read; ids < 2**53 are exact in float64
    out: list[TokenLogprobs] = []
    for token, n, row in zip(tokens, top_n, host):
        entry = {int(row[1 + k + j]): row[1 + j] for j in range(n)}
        entry.setdefault(token, row[0])
        out.append(entry)
    return out


def attach_logprobs(logits: torch.Tensor, updates: list, token_rows: dict[int, list[int]]) -> None:
    """Set ``update.logprobs`` (one dict per ``update.new_tokens``) for the updates whose request asked for
    logprobs (``params.logprobs is not None``); the others are left at None.

    Args:
        logits: fp32 ``[R, V]``, the step's target logits.
        updates: the step's ``RequestUpdate`` s (engine/step.py).
        token_rows: seq id -> the row of ``logits`` each of its new tokens was drawn from, in order (a chain:
            window row j for token j; a tree: the rows of the accepted path's nodes).
    """
    wanted = [u for u in updates if u.seq.params.logprobs is not None and u.new_tokens]
    rows, tokens, top_n = [], [], []
    for u in wanted:
        r = token_rows[u.seq.seq_id]
        assert len(r) == len(u.new_tokens), "one logits row per emitted token"
        rows += r
        tokens += u.new_tokens
        top_n += [u.seq.params.logprobs] * len(r)
    flat = token_logprobs(logits, rows, tokens, top_n)
    i = 0
    for u in wanted:
        u.logprobs = flat[i : i + len(u.new_tokens)]
        i += len(u.new_tokens)
