"""EAGLE-3's training-time test: the head unrolled for K draft steps, each step fed its own previous output.

Alignment (the inference proposer's, ``specdec/spec_decode/proposers/eagle3.py``): row p of step 0 is the head's
entry at position p - the target's hidden state of token p (fused by ``fc``) with the embedding of token p + 1 -
and predicts token p + 2, whose target distribution is the target's logits at row p + 1. Step j keeps the rows
and feeds row p the head's own output of step j - 1 at row p with the embedding of token p + 1 + j, at position
p + j; it predicts token p + 2 + j (the target's row p + 1 + j). Its attention sees the step-0 keys of rows
0..p (the context entries) and the keys of steps 1..j at row p only (the chain's own draft entries) - what draft
step j attends to at inference (SpecForge's ``cache_hidden``).

Loss of step j: cross-entropy from the target's distribution over the draft vocabulary (softmax of the target's
logits restricted to those ids) to the head's, averaged over the rows that predict an answer token whose target
top-1 token (over the whole vocabulary) is inside the draft vocabulary (SpecForge's position mask); the total is
the mean over steps weighted ``decay ** j``.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from specdec.training.head import TrainHead


@dataclass
class TTTBatch:
    """A padded batch of B samples of up to T tokens (right-padded)."""

    input_ids: torch.Tensor  # int64 [B, T] the sample's tokens (0 past its end)
    aux: torch.Tensor  # [B, T, 3 * H_target] the target's hidden states at the head's layers
    valid: torch.Tensor  # bool [B, T] row r's target distribution is a training signal (answer, top-1 in draft)
    target_p: torch.Tensor  # fp32 [N_valid, D] the target's distribution over the draft vocabulary, valid rows
    row_of: torch.Tensor  # int64 [B, T] index into target_p of a valid row, -1 elsewhere


def collate(samples: list[tuple[list[int], int, dict[str, torch.Tensor]]], target_lm_rows: torch.Tensor,
            t2d: torch.Tensor, dtype: torch.dtype, device: torch.device) -> TTTBatch:
    """A :class:`TTTBatch` from ``(ids, prompt_len, features)`` triples (``features.py``): the target's logits
    over the draft vocabulary are ``final @ target_lm_rows.T`` (``target_lm_rows`` [D, H_target], its LM head's
    rows of the draft ids); rows from ``prompt_len - 1`` on predict answer tokens."""
    b, t = len(samples), max(len(ids) for ids, _, _ in samples)
    width = samples[0][2]["aux"].shape[-1]
    input_ids = torch.zeros(b, t, dtype=torch.int64)
    aux = torch.zeros(b, t, width, dtype=dtype)
    valid = torch.zeros(b, t, dtype=torch.bool)
    finals = []
    for i, (ids, prompt_len, feats) in enumerate(samples):
        n = len(ids)
        assert feats["aux"].shape[0] == n, "features do not match their sample (stale OUT/data/features?)"
        input_ids[i, :n] = torch.tensor(ids)
        aux[i, :n] = feats["aux"].to(dtype)
        row_ok = t2d[feats["argmax"]]  # (n,) the target's top-1 is in the draft vocabulary
        row_ok[: max(prompt_len - 1, 0)] = False  # rows predicting prompt tokens
        valid[i, :n] = row_ok
        finals.append(feats["final"][row_ok])
    final = torch.cat(finals).to(device, torch.float32)  # (N_valid, H_target)
    with torch.no_grad():
        target_p = (final @ target_lm_rows.to(device, torch.float32).T).softmax(-1)  # (N_valid, D)
    row_of = torch.full((b, t), -1, dtype=torch.int64)
    row_of[valid] = torch.arange(int(valid.sum()))
    return TTTBatch(input_ids.to(device), aux.to(device), valid.to(device), target_p, row_of.to(device))


def _shift_left(x: torch.Tensor, n: int, fill) -> torch.Tensor:
    """``x [B, T]`` moved left by ``n`` columns, ``fill`` coming in on the right."""
    out = torch.full_like(x, fill)
    if n < x.shape[1]:
        out[:, : x.shape[1] - n] = x[:, n:]
    return out


def unroll(head: TrainHead, embedding: torch.Tensor, input_ids: torch.Tensor, aux: torch.Tensor, steps: int
           ) -> Iterator[torch.Tensor]:
    """The head's pre-norm outputs ``[B, T, H]`` of draft steps 0..steps-1 (``head.logits`` of step j, row p:
    the head's prediction of token p + 2 + j), for ``input_ids`` int64 ``[B, T]`` and the target's states ``aux``
    ``[B, T, 3 * H_target]``; ``embedding`` [V, H] is the target's (frozen)."""
    b, t = input_ids.shape
    base_pos = torch.arange(t, device=input_ids.device).expand(b, t)  # (B, T)
    hidden = head.fuse(aux.to(head.fc.weight.dtype))  # (B, T, H)
    cache: list[tuple[torch.Tensor, torch.Tensor]] = []
    for j in range(steps):
        ids = _shift_left(input_ids, 1 + j, 0)  # (B, T) token p + 1 + j
        embeds = F.embedding(ids, embedding).to(hidden.dtype)  # (B, T, H)
        hidden = head.step(embeds, hidden, base_pos + j, cache)  # (B, T, H)
        yield hidden


def ttt_loss(head: TrainHead, embedding: torch.Tensor, batch: TTTBatch, steps: int, decay: float = 0.8
             ) -> tuple[torch.Tensor, list[float], list[float]]:
    """``(loss, per-step losses, per-step top-1 agreement with the target)`` of ``head`` unrolled for ``steps``
    draft steps over ``batch``; ``embedding`` [V, H] is the target's (frozen). The loss is a 0-dim tensor to
    backpropagate; the lists are floats (NaN for a step with no row)."""
    total = torch.zeros((), dtype=torch.float32, device=batch.input_ids.device)
    weight_sum = 0.0
    losses, accs = [], []
    for j, hidden in enumerate(unroll(head, embedding, batch.input_ids, batch.aux, steps)):
        rows = _shift_left(batch.row_of, 1 + j, -1)  # (B, T) target row p + 1 + j, if it is a valid one
        keep = rows >= 0
        if not bool(keep.any()):
            losses.append(float("nan"))
            accs.append(float("nan"))
            continue
        logits = head.logits(hidden[keep]).float()  # (N_j, D)
        target_p = batch.target_p[rows[keep]]  # (N_j, D)
        loss = -(target_p * logits.log_softmax(-1)).sum(-1).mean()
        total = total + decay**j * loss
        weight_sum += decay**j
        losses.append(float(loss.detach()))
        accs.append(float((logits.argmax(-1) == target_p.argmax(-1)).float().mean()))
    return total / max(weight_sum, 1e-12), losses, accs
