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
