"""What the head learns from: one teacher-forced target pass over each sample (prompt + answer), on disk.

Per sample ``OUT/data/features/NNNNNN.safetensors`` holds (T = the sample's length):

- ``aux``    [T, 3 * H_target]  the residual stream entering the head's three target layers (the engine's capture,
  ``ModelRunner.forward_with_aux_hidden``: the states the head is fed at inference), storage dtype;
- ``final``  [T, H_target]      the target's final-norm hidden state: the trainer turns it into the target's logits
  over the draft vocabulary (its LM head's rows), so no ``[T, V]`` tensor is kept;
- ``argmax`` int64 [T]          the target's top token over its whole vocabulary (positions whose top token is
  outside the draft vocabulary are masked, as SpecForge does).

Features are computed once (resumable: samples with a file are skipped) and read back per training batch, so the
dataset's hidden states are never held in memory at once.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from tqdm import tqdm

from specdec.runner.model_runner import ForwardItem
from specdec.training.data import Sample

_SEQ_ID = 1_000_000  # seq ids of the feature pass in the target's block manager (nothing else runs there)


def feature_file(features_dir: str | os.PathLike, index: int) -> Path:
    return Path(features_dir) / f"{index:06d}.safetensors"


@torch.no_grad()  # NOTE: not inference_mode: the staging buffers must stay normal tensors
def target_features(engine, items: list[list[int]], aux_layers: tuple[int, ...], storage_dtype: torch.dtype
                    ) -> list[dict[str, torch.Tensor]]:
    """One ragged target forward over the sequences ``items`` (token ids); per sequence ``{"aux" [T, 3H],
    "final" [T, H], "argmax" int64 [T]}`` on the CPU (hidden states in ``storage_dtype``)."""
    model, runner, bm = engine.model, engine.runner, engine.block_manager
    hidden = model.config.hidden_size
    layers = tuple(aux_layers) + (model.config.num_hidden_layers,)  # the last one: the final hidden state
    seq_ids = [_SEQ_ID + i for i in range(len(items))]
    for sid, ids in zip(seq_ids, items, strict=True):
        bm.allocate(sid, len(ids))
    try:
        fwd = [ForwardItem(sid, ids, 0, len(ids)) for sid, ids in zip(seq_ids, items, strict=True)]
        logits, aux = runner.forward_with_aux_hidden(fwd, layers)  # fp32 [sum T, V], [sum T, 4H]
    finally:
        for sid in seq_ids:
            bm.free(sid)
    n = len(aux_layers) * hidden
    final = model.norm(aux[:, n:])  # (sum T, H)
    argmax = logits.argmax(-1)  # (sum T,)
    out, lo = [], 0
    for ids in items:
        hi = lo + len(ids)
        out.append({"aux": aux[lo:hi, :n].to("cpu", storage_dtype).contiguous(),
                    "final": final[lo:hi].to("cpu", storage_dtype).contiguous(),
                    "argmax": argmax[lo:hi].to("cpu", torch.int64).contiguous()})
        lo = hi
    return out


def write_features(engine, samples: list[Sample], features_dir: str | os.PathLike, aux_layers: tuple[int, ...],
                   storage_dtype: torch.dtype = torch.bfloat16, max_logits_bytes: int = 256 << 20) -> None:
    """Write the features of every sample without a file yet, batching as many tokens as keep the forward's fp32
    logits ``[tokens, V]`` under ``max_logits_bytes`` (a longer sample goes alone)."""
    max_batch_tokens = max(1, max_logits_bytes // (4 * engine.model.config.vocab_size))
    features_dir = Path(features_dir)
    features_dir.mkdir(parents=True, exist_ok=True)
    todo = [i for i in range(len(samples)) if not feature_file(features_dir, i).is_file()]
    with tqdm(total=len(samples), initial=len(samples) - len(todo), desc="target features", unit="sample") as bar:
        while todo:
            batch, tokens = [], 0
            while todo and (not batch or tokens + len(samples[todo[0]].ids) <= max_batch_tokens):
                batch.append(todo.pop(0))
                tokens += len(samples[batch[-1]].ids)
            feats = target_features(engine, [samples[i].ids for i in batch], aux_layers, storage_dtype)
            for i, f in zip(batch, feats, strict=True):
                tmp = feature_file(features_dir, i).with_suffix(".tmp")
                save_file(f, str(tmp))
                os.replace(tmp, feature_file(features_dir, i))  # a file is there whole or not at all
            bar.update(len(batch))


def read_features(features_dir: str | os.PathLike, index: int) -> dict[str, torch.Tensor]:
    return load_file(str(feature_file(features_dir, index)))
