"""Rank 0's stand-ins for a sharded model and its pool: the engine's runner calls them exactly as it calls a
``LlamaForCausalLM`` and a ``KVPool``; they send each forward's inputs (and each KV compaction) to the workers
through the link (``driver_link.DriverLink``), then run rank 0's shard of the same work (vLLM's driver/worker
split)."""

from __future__ import annotations

from typing import Protocol

import torch

from specdec.cache.kv_pool import KVPool
from specdec.distributed.comm import TensorParallelError, TPGroup
from specdec.distributed.payload import CompactHeader, ForwardHeader, pack_forward
from specdec.model.llama import AttentionMetadata, LlamaForCausalLM


class WorkerLink(Protocol):
    """What the stand-ins need of the workers (``driver_link.DriverLink``)."""

    group: TPGroup

    def send(self, header: ForwardHeader | CompactHeader, payload: torch.Tensor | None = None) -> None:
        """The header and its payload to every worker; ``TensorParallelError`` if one is gone or the group is
        broken."""


def _broken(link: WorkerLink, e: BaseException) -> TensorParallelError:
    """After a failure inside a broadcast piece of work the ranks no longer agree: the group is broken for good."""
    if link.group.broken is None:
        link.group.broken = f"rank 0 failed mid-forward: {type(e).__name__}: {e}"
    return e if isinstance(e, TensorParallelError) else TensorParallelError(link.group.broken)


class TensorParallelModel:
    """Rank 0 of a model sharded over ``link.group``: ``__call__`` has ``LlamaForCausalLM.forward``'s signature
    and result (fp32 logits ``[N, V]``, gathered from every rank's vocabulary shard)."""

    def __init__(self, local: LlamaForCausalLM, model_id: int, link: WorkerLink):
        self.local = local  # rank 0's shard
        self.model_id = model_id  # how the workers name it (0: target, 1: draft)
        self.link = link
        self.config = local.config  # the full model's
        self.layout = local.layout

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_cache: tuple[torch.Tensor, torch.Tensor],
                 meta: AttentionMetadata, logits_indices: torch.Tensor) -> torch.Tensor:
        """One forward on every rank: ``input_ids, positions int64 [T]``, this rank's ``kv_cache`` (each ``[L,
        num_blocks, block_size, Hkv / N, D]``), ``meta``, ``logits_indices int64 [N]`` -> fp32 logits ``[N, V]``."""
        return self._on_every_rank(self.local, input_ids, positions, kv_cache, meta, logits_indices)

    forward = __call__

    def forward_with_aux_hidden(self, input_ids: torch.Tensor, positions: torch.Tensor,
                                kv_cache: tuple[torch.Tensor, torch.Tensor], meta: AttentionMetadata,
                                logits_indices: torch.Tensor, aux_layers: tuple[int, ...]
                                ) -> tuple[torch.Tensor, torch.Tensor]:
        """``LlamaForCausalLM.forward_with_aux_hidden`` on every rank (the workers run a plain forward): fp32
        logits ``[N, V]`` and the hidden states ``[T, len(aux_layers) * hidden]`` entering ``aux_layers``. The
        residual stream is whole on every rank after each layer's all-reduce, so rank 0's capture is the full
        hidden state, and it costs no communication."""
        return self._on_every_rank(self.local.forward_with_aux_hidden, input_ids, positions, kv_cache, meta,
                                   logits_indices, aux_layers)

    def _on_every_rank(self, local_forward, input_ids: torch.Tensor, positions: torch.Tensor,
                       kv_cache: tuple[torch.Tensor, torch.Tensor], meta: AttentionMetadata,
                       logits_indices: torch.Tensor, *extra):
        """Send the forward's header and payload to the workers, then run ``local_forward`` on rank 0's shard."""
        header, payload = pack_forward(self.model_id, input_ids, positions, meta, logits_indices)
        try:
            self.link.send(header, payload)
            return local_forward(input_ids, positions, kv_cache, meta, logits_indices, *extra)
        except Exception as e:  # noqa: BLE001 - re-raised as the group's failure
            raise _broken(self.link, e) from e

    def modules(self):
        return self.local.modules()

    @property
    def embed_tokens(self):
        return self.local.embed_tokens

    @property
    def lm_head(self):
        return self.local.lm_head


class DriverKVPool(KVPool):
    """Rank 0's pool of a sharded model (its kv heads); ``compact`` runs the same moves on every rank's pool."""

    def __init__(self, local: LlamaForCausalLM, model_id: int, link: WorkerLink, num_blocks: int, block_size: int,
                 dtype: torch.dtype, device: torch.device):
        super().__init__(local.config, num_blocks, block_size, dtype, device, local.layout.num_kv_heads)
        self.model_id = model_id
        self.link = link

    def compact(self, src_slots: torch.Tensor, dst_slots: torch.Tensor) -> None:
        """``KVPool.compact`` on every rank: the moves sent as one int64 ``[2 * N]`` payload."""
        try:
            self.link.send(CompactHeader(self.model_id, src_slots.shape[0]), torch.cat([src_slots, dst_slots]))
        except Exception as e:  # noqa: BLE001
            raise _broken(self.link, e) from e
        super().compact(src_slots, dst_slots)
