"""A reduced draft vocabulary for a draft model (EAGLE-3's ``d2t``, for standalone drafts): its LM head keeps the
rows of a subset S of the target's token ids (e.g. the 32k most frequent), so a small draft stops paying for a
128k/152k-row head. Draft logits are ``[N, |S|]``; column c is target id ``target_ids[c]`` (ascending).

q is exactly 0 outside S - the draft never proposes those ids - and verification uses exactly that q, so it stays
lossless: the target still emits them through the correction or the bonus token. The draft's inputs are unchanged
(its embedding is whole; only the head is cut: specdec/model/subset_head.py).

The file ``SpeculativeConfig(draft_vocab=PATH)`` names (:func:`read_draft_vocab`):

- ``.json``: a list of target ids, or ``{"token_ids": [...], "counts": [...], "target_vocab_size": V}`` as written by
  ``specdec draft-vocab`` (:func:`write_draft_vocab`), most frequent first - ``draft_vocab_size=N`` keeps the first N;
- ``.safetensors`` / ``.pt``: EAGLE-3's map - ``d2t`` (int ``[D]``: draft id i is target id ``i + d2t[i]``) and / or
  ``t2d`` (bool ``[V]``) - as in ``specdec train-draft``'s ``OUT/data/vocab.safetensors``, an EAGLE-3 head's
  ``model.safetensors`` or SpecForge's vocabulary-mapping ``.pt``. These hold no frequency order: the whole set.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from specdec.config import check_draft_vocab_path
from specdec.sampling.penalties import PenaltyCounts


@dataclass(frozen=True)
class DraftVocabFile:
    """What a draft-vocabulary file holds: its ids in file order and whether that order is by frequency."""

    token_ids: list[int]  # most frequent first when ``ranked``; ascending for a d2t / t2d map
    ranked: bool
    target_vocab_size: int | None  # the vocabulary it was built for (JSON ``target_vocab_size``, t2d's length)


def read_draft_vocab_file(path: str | os.PathLike) -> DraftVocabFile:
    """The ids a draft-vocabulary file names (formats: the module docstring); ``ValueError`` on a malformed one."""
    check_draft_vocab_path(path)
    name = str(path)
    if name.endswith(".json"):
        with open(path, encoding="utf-8") as f:
            try:
                raw = json.load(f)
            except json.JSONDecodeError as e:
                raise ValueError(f"draft_vocab {name}: not valid JSON ({e})") from None
        recorded = raw.get("target_vocab_size") if isinstance(raw, dict) else None
        ids = raw.get("token_ids") if isinstance(raw, dict) else raw
        if not isinstance(ids, list) or any(not isinstance(t, int) or isinstance(t, bool) for t in ids):
            raise ValueError(f"draft_vocab {name}: expected a JSON list of integer token ids, or an object whose "
                             "'token_ids' is one")
        if recorded is not None and (not isinstance(recorded, int) or isinstance(recorded, bool)):
            raise ValueError(f"draft_vocab {name}: 'target_vocab_size' must be an integer, got {recorded!r}")
        return DraftVocabFile(ids, True, recorded)
    tensors = _read_map(name)
    d2t, t2d = tensors.get("d2t"), tensors.get("t2d")
    if d2t is None and t2d is None:
        raise ValueError(f"draft_vocab {name}: holds neither 'd2t' nor 't2d' (an EAGLE-3 vocabulary map)")
    for key, t in (("d2t", d2t), ("t2d", t2d)):
        if t is not None and t.dim() != 1:
            raise ValueError(f"draft_vocab {name}: '{key}' must be 1-dimensional, got shape {tuple(t.shape)}")
    if d2t is not None and (d2t.dtype.is_floating_point or d2t.dtype == torch.bool):
        raise ValueError(f"draft_vocab {name}: 'd2t' must hold integer offsets, got {d2t.dtype}")
    ids = ((torch.arange(d2t.numel()) + d2t.long()) if d2t is not None else t2d.bool().nonzero().flatten())
    if d2t is not None and t2d is not None:
        mark = t2d.bool()
        inside = ids[(ids >= 0) & (ids < mark.numel())]
        if int(mark.sum()) != ids.numel() or inside.numel() != ids.numel() or not bool(mark[inside].all()):
            raise ValueError(f"draft_vocab {name}: 't2d' does not mark exactly the target ids 'd2t' maps to")
    return DraftVocabFile(ids.tolist(), False, t2d.numel() if t2d is not None else None)


def _read_map(name: str) -> dict[str, torch.Tensor]:
    """``d2t`` / ``t2d`` of a safetensors file (read alone, not the weights beside them) or a ``.pt`` dict."""
    if name.endswith(".safetensors"):
        from safetensors import safe_open

        try:
            with safe_open(name, framework="pt") as f:
                return {k: f.get_tensor(k) for k in ("d2t", "t2d") if k in f.keys()}
        except Exception as e:  # noqa: BLE001 - safetensors raises its own error types for a damaged file
            raise ValueError(f"draft_vocab {name}: not a readable safetensors file ({e})") from None
    try:
        raw = torch.load(name, map_location="cpu", weights_only=True)
    except Exception as e:  # noqa: BLE001 - a damaged or foreign pickle
        raise ValueError(f"draft_vocab {name}: not a readable torch file of tensors ({e})") from None
    if not isinstance(raw, dict):
        raise ValueError(f"draft_vocab {name}: expected a dict with 'd2t' and / or 't2d', got {type(raw).__name__}")
    return {k: torch.as_tensor(raw[k]) for k in ("d2t", "t2d") if k in raw}


def read_draft_vocab(path: str | os.PathLike, size: int | None, target_vocab_size: int, draft_vocab_size: int
                     ) -> torch.Tensor:
    """The reduced draft vocabulary: int64 ``[S]`` target ids, ascending (the subset head's row order).

    Args:
        path: the file (formats: the module docstring).
        size: keep the first ``size`` ids of a frequency-ranked (JSON) file; None: all of them.
        target_vocab_size: the target's vocabulary V (a file recording another V was built for another model).
        draft_vocab_size: the draft model's vocabulary (<= V): every id must have a row in its LM head.
    Raises ``ValueError`` naming the problem: empty, duplicates, ids out of range, ``size`` too large or used with
    a file in id order, a file built for another vocabulary.
    """
    file = read_draft_vocab_file(path)
    ids = file.token_ids
    if file.target_vocab_size is not None and file.target_vocab_size != target_vocab_size:
        raise ValueError(f"draft_vocab {path} was built for a vocabulary of {file.target_vocab_size} ids; the target "
                         f"has {target_vocab_size}")
    if not ids:
        raise ValueError(f"draft_vocab {path} holds no token ids")
    if size is not None:
        if not file.ranked and size != len(ids):
            raise ValueError(f"draft_vocab_size={size}: {path} is an EAGLE-3 map in id order, not ranked by "
                             "frequency, so it cannot be cut; drop draft_vocab_size or build a ranked file with "
                             "`specdec draft-vocab`")
        if size > len(ids):
            raise ValueError(f"draft_vocab_size={size} is larger than the {len(ids)} ids in {path}")
        ids = ids[:size]
    t = torch.tensor(ids, dtype=torch.int64)  # [S] in file order
    bad = ((t < 0) | (t >= draft_vocab_size)).nonzero().flatten()
    if bad.numel():
        at = int(bad[0])
        why = ("the draft model's vocabulary (its LM head has no row for it)" if draft_vocab_size < target_vocab_size
               else "the target's vocabulary")
        raise ValueError(f"draft_vocab {path}: token id {ids[at]} (entry {at}) is outside [0, {draft_vocab_size}), "
                         f"{why}")
    unique, counts = torch.unique(t, return_counts=True)
    if unique.numel() != t.numel():
        raise ValueError(f"draft_vocab {path}: token id {int(unique[counts > 1][0])} appears more than once")
    return unique  # sorted ascending


def write_draft_vocab(path: str | os.PathLike, token_ids: list[int], counts: list[int], target_vocab_size: int
                      ) -> None:
    """Write a ranked draft-vocabulary file (``token_ids`` most frequent first, with their ``counts``)."""
    with open(path, "w", encoding="utf-8") as f:
        json.dump({"target_vocab_size": target_vocab_size, "token_ids": token_ids, "counts": counts}, f)
        f.write("\n")


class DraftVocab:
    """The map between the subset head's columns and target ids, for the sampler and the q layout.

    Args:
        target_ids: int64 ``[S]`` ascending (:func:`read_draft_vocab`): column c is target id ``target_ids[c]``.
        target_vocab_size: V, the width q rows are laid out over.
        device: where the drafted ids and q live.
    """

    def __init__(self, target_ids: torch.Tensor, target_vocab_size: int, device: torch.device):
        assert target_ids.dim() == 1 and bool((target_ids[1:] > target_ids[:-1]).all()), "ids must ascend"
        self.size = target_ids.numel()
        self.target_vocab_size = target_vocab_size
        self.target_ids = target_ids.to(device=device, dtype=torch.int64)  # int64 [S]
        self._columns = np.full(target_vocab_size, -1, dtype=np.int64)  # target id -> its column, -1 outside S
        self.host_ids = target_ids.cpu().numpy()  # int64 [S]: column c's target id, on the host (grammar masks)
        self._columns[self.host_ids] = np.arange(self.size)

    def to_target(self, columns: torch.Tensor) -> torch.Tensor:
        """Target ids of the columns ``columns`` (int64, any shape, on the device; no host read)."""
        return self.target_ids[columns]

    def context(self, context: PenaltyCounts | None) -> PenaltyCounts | None:
        """A penalty context over target ids -> over columns (ids outside S dropped: they have no logit)."""
        if context is None:
            return None
        ids, counts = context
        columns = self._columns[ids]  # [D]
        keep = columns >= 0
        return columns[keep], counts[keep]

    def scatter(self, probs: torch.Tensor) -> torch.Tensor:
        """q over the columns fp32 ``[R, S]`` -> over the target's vocabulary ``[R, V]``, exactly 0 outside S."""
        out = probs.new_zeros(probs.shape[0], self.target_vocab_size)
        return out.index_copy_(1, self.target_ids, probs)


def q_over_target(probs: torch.Tensor, vocab: DraftVocab | None, target_vocab_size: int) -> torch.Tensor:
    """Draft q rows ``[R, W]`` laid out over the target's vocabulary ``[R, V]``: through ``vocab``'s columns, or
    (None) the draft's ids themselves, zero-padded beyond a smaller draft vocabulary (W <= V)."""
    if vocab is not None:
        return vocab.scatter(probs)
    width = probs.shape[1]
    return F.pad(probs, (0, target_vocab_size - width)) if width < target_vocab_size else probs
