"""The grammar mask applied to logits rows: the constrained distribution, for sampling and for verification.

A masked token's logit becomes ``min(row) - MASK_OFFSET``: after any temperature up to ~9600 its softmax weight
underflows to exactly 0 in fp32, and the row stays finite (the samplers refuse rows with NaN/inf: a -inf mask would
trip them). Greedy rows take the argmax of the masked row: never a masked token while one is allowed. A row with no
allowed token is left as it is (the request's next ``accept`` then fails and ends it with an error).
"""

from __future__ import annotations

import numpy as np
import torch

from specdec.device import to_device

MASK_OFFSET = 1.0e6


def mask_logits(logits: torch.Tensor, rows: list[int], allowed: np.ndarray) -> None:
    """In place: rows ``rows`` of ``logits`` (fp32 ``[R, V]``) keep the tokens ``allowed`` (bool ``[len(rows), V]``,
    host) and push the others below every kept one. One host-to-device copy of the mask."""
    if not rows:
        return
    index = to_device(rows, torch.int64, logits.device)
    allowed = np.ascontiguousarray(allowed[:, : logits.shape[1]])
    keep = allowed | ~allowed.any(axis=1, keepdims=True)  # a row with nothing allowed stays as it is
    keep_t = to_device(keep, torch.bool, logits.device)  # bool [N, V]
    with torch.inference_mode():  # the forward's logits are inference tensors
        sub = logits.index_select(0, index)  # [N, V]
        floor = sub.amin(dim=-1, keepdim=True) - MASK_OFFSET  # [N, 1]
        logits.index_copy_(0, index, torch.where(keep_t, sub, floor))
