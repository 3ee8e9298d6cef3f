"""SamplingMetadata: everything the sampler needs for R logits rows, as tensors built once per step."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from specdec.device import to_device
from specdec.sampling.params import SamplingParams
from specdec.sampling.penalties import PenaltyCounts, PenaltyRows, penalty_rows
from specdec.sampling.probs import SamplingTensors


@dataclass
class SamplingMetadata:
    """Per-row sampling inputs of ``R`` rows (no ``Sequence`` objects: the sampler sees tensors only)."""

    st: SamplingTensors  # temperature / top-k / top-p / min-p / penalty settings, [R] each
    seeds: torch.Tensor | None  # int64 [R]: the request seeds (the Philox key); None when every row is greedy
    positions: torch.Tensor | None  # int64 [R]: absolute position of the token drawn (the Philox counter); ditto
    penalties: PenaltyRows | None  # sparse penalty context; None when no row has a penalty

    @property
    def num_rows(self) -> int:
        return self.st.temperature.shape[0]

    @classmethod
    def build(cls, params: list[SamplingParams], seeds: list[int], positions: list[int],
              contexts: list[PenaltyCounts | None], vocab_size: int, device: torch.device | str) -> SamplingMetadata:
        """From per-row lists. ``contexts[r]``: row r's penalty context (``Sequence.penalty_counts``, or
        ``penalties.row_counts`` of two lists), read only when the row has a penalty; None for rows without."""
        num_rows = len(params)
        for name, values in (("seeds", seeds), ("positions", positions), ("contexts", contexts)):
            if len(values) != num_rows:
                raise ValueError(f"SamplingMetadata needs one entry per row in {name}: got {len(values)} for "
                                 f"{num_rows} rows")
        st = SamplingTensors.from_params(params, device)
        keys = None
        if not st.all_greedy:
            keys = to_device([seeds, positions], torch.int64, device).reshape(2, num_rows)  # [2, R]
        pen = None
        if st.any_penalty:
            pen = penalty_rows([c if p.has_penalties else None for p, c in zip(params, contexts)], vocab_size,
                               device)
        return cls(st, keys[0] if keys is not None else None, keys[1] if keys is not None else None, pen)
