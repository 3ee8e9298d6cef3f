"""Plain (non-speculative) next-token sampling: penalties -> probabilities (to_probs) -> exact sampling by inverse
CDF with one Philox uniform per row."""

from __future__ import annotations

import torch

from specdec import ops
from specdec.kernels.philox import STREAM_SAMPLE
from specdec.sampling.metadata import SamplingMetadata
from specdec.sampling.params import SamplingParams
from specdec.sampling.penalties import PenaltyCounts
from specdec.sampling.probs import apply_penalty_rows, to_probs, to_probs_unchecked


def greedy(logits: torch.Tensor) -> torch.Tensor:
    """The one argmax every greedy path uses (plain decoding and speculative verification): int64 ``[R]``."""
    return logits.argmax(dim=-1)


def sample_from_probs(probs: torch.Tensor, seeds: torch.Tensor, positions: torch.Tensor, stream: int) -> torch.Tensor:
    """Exact categorical sampling of each row of ``probs [R, V]`` by inverse CDF: one uniform U per row from
    Philox(seed, position, stream), the token the first id whose cumulative probability exceeds U times the row's
    total (``specdec.kernels.inverse_cdf``; rows need not be normalised; the Triton kernel on CUDA, its torch
    reference elsewhere). int64 ``[R]`` on ``probs``' device."""
    return ops.sample_inverse_cdf(probs, seeds, positions, stream)


def sample_next_tokens(
    logits: torch.Tensor,
    params: list[SamplingParams],
    seeds: list[int],
    positions: list[int],
    contexts: list[PenaltyCounts | None],
    bad_rows: list[torch.Tensor] | None = None,
) -> torch.Tensor:
    """Next token per row, int64 ``[R]``; raises ``FloatingPointError`` on NaN/inf logits (or, with ``bad_rows``,
    appends their bool ``[R]`` flags there for the caller to check - see :func:`sample_rows`).

    Args:
        logits: fp32 ``[R, V]``.
        seeds, positions: per row, the request seed and the absolute position of the token being sampled.
        contexts: per row, its penalty context (``Sequence.penalty_counts``), or None without penalties.
    """
    return sample_rows(logits, params, seeds, positions, contexts, STREAM_SAMPLE, bad_rows=bad_rows)[0]


def sample_rows(
    logits: torch.Tensor,
    params: list[SamplingParams],
    seeds: list[int],
    positions: list[int],
    contexts: list[PenaltyCounts | None],
    stream: int,
    bad_rows: list[torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(tokens int64 [R], probs fp32 [R, V] or None when every row is greedy) - the sampler of plain decoding
    and of draft models (``stream`` keeps their random numbers apart). ``probs`` is the distribution (``to_probs``)
    each sampled row was drawn from (garbage for greedy rows).

    NaN/inf logits raise ``FloatingPointError`` (a host read), unless ``bad_rows`` is given: then the bool ``[R]``
    of bad rows is appended to it, on the device, and the caller must check it before using those rows' tokens.
    """
    meta = SamplingMetadata.build(params, seeds, positions, contexts, logits.shape[-1], logits.device)
    return sample_with_metadata(logits, meta, stream, bad_rows=bad_rows)


def sample_with_metadata(
    logits: torch.Tensor, meta: SamplingMetadata, stream: int, bad_rows: list[torch.Tensor] | None = None
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """:func:`sample_rows` on prepared metadata: ``(tokens int64 [R], probs fp32 [R, V] or None)`` for the rows of
    ``logits`` (fp32 ``[R, V]``), ``meta`` holding one row each."""
    st = meta.st
    if meta.penalties is not None:
        logits = apply_penalty_rows(logits, meta.penalties, st)
    if st.all_greedy:
        if bad_rows is None:
            check_finite(logits)
        else:
            bad_rows.append(nonfinite_rows(logits))
        return greedy(logits), None
    if bad_rows is None:
        probs = to_probs(logits, st)
    else:
        probs, bad = to_probs_unchecked(logits, st)  # bad: the rows to_probs() would raise for
        bad_rows.append(bad)
    sampled = sample_from_probs(probs, meta.seeds, meta.positions, stream)
    if not st.any_greedy:  # no argmax pass over [R, V] for a batch without greedy rows
        return sampled, probs
    return torch.where(st.temperature == 0, greedy(logits), sampled), probs


def nonfinite_rows(logits: torch.Tensor) -> torch.Tensor:
    """bool ``[R]``: rows of ``logits [R, V]`` holding a NaN or an inf (greedy rows are refused on these).

    A row is finite iff its max and min are (a NaN propagates through both reductions): two vectorised
    reductions, ~10x cheaper on CPU than an elementwise ``isfinite`` over ``[R, V]`` and its ``all``."""
    return ~(torch.isfinite(logits.amax(dim=-1)) & torch.isfinite(logits.amin(dim=-1)))


def check_finite(logits: torch.Tensor) -> None:
    """Raise ``FloatingPointError`` naming the rows with NaN/inf logits (a host read)."""
    bad = nonfinite_rows(logits)
    if bool(bad.any()):
        rows = bad.nonzero().flatten().tolist()
        raise FloatingPointError(f"non-finite logits (NaN or inf) in rows {rows}; refusing to decode them")
