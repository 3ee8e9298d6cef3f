"""Logits to probabilities: the one function (``to_probs``) that turns logits into the distribution a token is drawn
from.

Used for the target's p and the draft's q alike (losslessness needs the same transform on both), in the
order of the contract: penalties -> temperature -> softmax -> top-k -> renormalise -> top-p -> renormalise
-> min-p. Greedy rows (temperature 0) take ``argmax`` of the penalised logits and never divide.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from specdec import ops
from specdec.device import to_device
from specdec.sampling.params import SamplingParams
from specdec.sampling.penalties import PenaltyRows


@dataclass
class SamplingTensors:
    """Per-row sampling settings as tensors (one row per logits row)."""

    temperature: torch.Tensor  # fp32 [R]
    top_k: torch.Tensor  # int64 [R]
    top_p: torch.Tensor  # fp32 [R]
    min_p: torch.Tensor  # fp32 [R]
    repetition_penalty: torch.Tensor  # fp32 [R]
    presence_penalty: torch.Tensor  # fp32 [R]
    frequency_penalty: torch.Tensor  # fp32 [R]
    any_penalty: bool
    any_filter: bool
    all_greedy: bool
    any_greedy: bool = True  # some row's fp32 temperature is 0 (its token is the argmax, not a sample)

    @classmethod
    def from_params(cls, params: list[SamplingParams], device: torch.device | str) -> SamplingTensors:
        # the float settings as one [6, R] table: one host-to-device copy, each row contiguous (kernels read them
        # as [R] vectors); numpy rounds each Python float to fp32 exactly as torch.tensor(..., float32) does
        table = np.array([(p.temperature, p.top_p, p.min_p, p.repetition_penalty, p.presence_penalty,
                           p.frequency_penalty) for p in params], dtype=np.float32).reshape(-1, 6)  # [R, 6]
        any_greedy = bool((table[:, 0] == 0).any())  # as the fp32 temperature says (1e-50 rounds to 0)
        table = to_device(np.ascontiguousarray(table.T), torch.float32, device)  # [6, R]
        return cls(
            temperature=table[0],
            top_k=to_device([p.top_k for p in params], torch.int64, device),
            top_p=table[1],
            min_p=table[2],
            repetition_penalty=table[3],
            presence_penalty=table[4],
            frequency_penalty=table[5],
            any_penalty=any(p.has_penalties for p in params),
            any_filter=any(p.top_k > 0 or p.top_p < 1 or p.min_p > 0 for p in params),
            all_greedy=all(p.is_greedy for p in params),
            any_greedy=any_greedy,
        )


def apply_penalties(
    logits: torch.Tensor,
    seen_mask: torch.Tensor | None,
    output_counts: torch.Tensor | None,
    st: SamplingTensors,
) -> torch.Tensor:
    """Penalised fp32 logits ``[R, V]`` from the dense context (a new tensor when a penalty is on; ``logits``
    itself is never changed): the reference the engine's sparse :func:`apply_penalty_rows` is tested against.

    Args:
        logits: ``[R, V]`` raw logits.
        seen_mask: bool ``[R, V]``, tokens present in prompt or output (repetition penalty), or None.
        output_counts: int ``[R, V]``, occurrences in the generated output so far (presence / frequency), or None.
    """
    logits = logits.float()
    if not st.any_penalty:
        return logits
    rep = st.repetition_penalty[:, None]
    penalised = torch.where(logits > 0, logits / rep, logits * rep)
    logits = torch.where(seen_mask, penalised, logits)
    counts = output_counts.float()
    logits = logits - st.frequency_penalty[:, None] * counts
    return logits - st.presence_penalty[:, None] * (counts > 0).float()


def apply_penalty_rows(logits: torch.Tensor, pr: PenaltyRows, st: SamplingTensors) -> torch.Tensor:
    """:func:`apply_penalties` on the sparse context: fp32 ``[R, V]``, the seen entries recomputed with the same
    fp32 operations in the same order (so each is bitwise what the dense form gives), every other logit copied.
    The dense form also subtracts ``penalty * 0`` from unseen logits, which changes no value (at most the sign of
    a zero)."""
    if not st.any_penalty:
        return logits.float()
    out = logits.to(torch.float32, copy=True)  # [R, V]
    if pr.rows.numel() == 0:
        return out
    values = out[pr.rows, pr.tokens]  # [N]
    rep = st.repetition_penalty[pr.rows]  # [N]
    values = torch.where(values > 0, values / rep, values * rep)
    counts = pr.counts.float()  # [N]
    values = values - st.frequency_penalty[pr.rows] * counts
    out[pr.rows, pr.tokens] = values - st.presence_penalty[pr.rows] * (counts > 0).float()
    return out


def to_probs(logits: torch.Tensor, st: SamplingTensors) -> torch.Tensor:
    """fp32 probabilities ``[R, V]`` from penalised logits; raises ``FloatingPointError`` on NaN/inf rows.

    Rows with temperature 0 are returned as computed at temperature 1 (callers take argmax for those).
    """
    probs, bad_row = to_probs_unchecked(logits, st)
    if bool(bad_row.any()):
        rows = bad_row.nonzero().flatten().tolist()
        raise FloatingPointError(f"non-finite logits (NaN or inf) in rows {rows}; refusing to sample from them")
    return probs


def to_probs_unchecked(logits: torch.Tensor, st: SamplingTensors) -> tuple[torch.Tensor, torch.Tensor]:
    """(probs fp32 ``[R, V]``, bad_row bool ``[R]``): :func:`to_probs` without the host read of its NaN/inf
    check - the caller checks ``bad_row`` (rows flagged there hold garbage)."""
    probs, bad_row = ops.softmax_with_temperature(logits, st.temperature)
    if st.any_filter:
        probs = ops.top_k_top_p_min_p(probs, st.top_k, st.top_p, st.min_p)
    return probs, bad_row
