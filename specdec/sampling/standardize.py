"""Standardization: the one function that turns logits into the distribution a token is drawn from.

Used for the target's p and the draft's q alike (losslessness needs the same transform on both), in the
order of the contract: penalties -> temperature -> softmax -> top-k -> renormalise -> top-p -> renormalise
-> min-p. Greedy rows (temperature 0) take ``argmax`` of the penalised logits and never divide.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from specdec import ops
from specdec.sampling.params import SamplingParams


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

    @classmethod
    def from_params(cls, params: list[SamplingParams], device: torch.device | str) -> SamplingTensors:
        def col(attr: str, dtype: torch.dtype) -> torch.Tensor:
            return torch.tensor([getattr(p, attr) for p in params], dtype=dtype, device=device)

        return cls(
            temperature=col("temperature", torch.float32),
            top_k=col("top_k", torch.int64),
            top_p=col("top_p", torch.float32),
            min_p=col("min_p", torch.float32),
            repetition_penalty=col("repetition_penalty", torch.float32),
            presence_penalty=col("presence_penalty", torch.float32),
            frequency_penalty=col("frequency_penalty", torch.float32),
            any_penalty=any(p.has_penalties for p in params),
            any_filter=any(p.top_k > 0 or p.top_p < 1 or p.min_p > 0 for p in params),
            all_greedy=all(p.is_greedy for p in params),
        )


def apply_penalties(
    logits: torch.Tensor,
    seen_mask: torch.Tensor | None,
    output_counts: torch.Tensor | None,
    st: SamplingTensors,
) -> torch.Tensor:
    """Penalised fp32 logits ``[R, V]``.

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


def standardize(logits: torch.Tensor, st: SamplingTensors) -> torch.Tensor:
    """fp32 probabilities ``[R, V]`` from penalised logits; raises ``FloatingPointError`` on NaN/inf rows.

    Rows with temperature 0 are returned as computed at temperature 1 (callers take argmax for those).
    """
    probs, bad_row = standardize_unchecked(logits, st)
    if bool(bad_row.any()):
        rows = bad_row.nonzero().flatten().tolist()
        raise FloatingPointError(f"non-finite logits (NaN or inf) in rows {rows}; refusing to sample from them")
    return probs


def standardize_unchecked(logits: torch.Tensor, st: SamplingTensors) -> tuple[torch.Tensor, torch.Tensor]:
    """(probs fp32 ``[R, V]``, bad_row bool ``[R]``): :func:`standardize` without the host read of its NaN/inf
    check - the caller checks ``bad_row`` (rows flagged there hold garbage)."""
    probs, bad_row = ops.softmax_with_temperature(logits, st.temperature)
    if st.any_filter:
        probs = ops.top_k_top_p_min_p(probs, st.top_k, st.top_p, st.min_p)
    return probs, bad_row
