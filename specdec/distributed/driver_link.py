"""Rank 0's end of a tensor-parallel engine, whatever started the other ranks (``launcher.py`` spawns them,
``torchrun.py`` finds them already running): the compute group, the command channel and rank 0's shards."""

from __future__ import annotations

import torch
import torch.distributed as dist

from specdec.distributed.channel import CommandChannel
from specdec.distributed.comm import TensorParallelError, TPGroup
from specdec.distributed.driver import DriverKVPool, TensorParallelModel
from specdec.distributed.payload import Header
from specdec.distributed.worker import ModelSpec, load_shard_model


class DriverLink:
    """Rank 0 of ``size`` ranks on ``device``: ``shards[i]`` is ``(TensorParallelModel, DriverKVPool)`` of
    ``models[i]`` (0: the target, 1: a draft sharded the same way) once ``load_shards`` ran; ``send`` carries each
    forward / compaction to the workers once ``connect`` ran. A launcher subclasses it with how the workers start
    and stop."""

    def __init__(self, size: int, device: torch.device, timeout_s: float, models: list[ModelSpec]):
        self.size = size
        self.device = device
        self.models = tuple(models)  # what every rank loads (and sizes its pools by)
        self.group = TPGroup(0, size, device, timeout_s)
        self.channel = CommandChannel(0, size, self.group, timeout_s)
        self.shards: list[tuple[TensorParallelModel, DriverKVPool]] = []

    def load_shards(self) -> None:
        """Rank 0's shard of every model and its pool, wrapped in the stand-ins that broadcast each forward."""
        locals_: list = []  # rank 0's shards so far (a self draft shares the target's embedding shard)
        for model_id, m in enumerate(self.models):
            local = load_shard_model(m, self.group, self.device, locals_)
            locals_.append(local)
            pool = DriverKVPool(local, model_id, self, m.num_blocks, m.block_size, m.dtype, self.device)
            self.shards.append((TensorParallelModel(local, model_id, self), pool))

    def connect(self, store: dist.Store) -> None:
        """Form the compute group and the command channel with the workers (blocks until every rank joined, at
        most the store's timeout)."""
        self.group.connect(store)
        self.channel.connect(store)

    @property
    def error(self) -> str | None:
        """Why the group cannot run another forward (a failed collective or command), or None while healthy."""
        return self.group.broken or self.channel.broken

    def send(self, header: Header, payload: torch.Tensor | None = None) -> None:
        """``header`` and its payload to every worker; ``TensorParallelError`` if one is gone or the group broke."""
        error = self.error
        if error is not None:
            raise TensorParallelError(f"a tensor-parallel worker died or hung ({error}); restart the engine")
        self.channel.send(header, payload)

    def stop_workers(self) -> bool:
        """Ask the workers to leave their serve loop (``stop_serving``); never raises."""
        return stop_serving(self.group, self.channel)

    def abort(self) -> None:
        """Give up both groups' connections; never raises."""
        abort_groups(self.group, self.channel)


def stop_serving(group: TPGroup, channel: CommandChannel) -> bool:
    """Send the workers the shutdown command; False (nothing sent) when the group is broken or was never formed -
    a worker may then be hung or not listening. Never raises. (Functions of the groups, not of the link, so that a
    finalizer can call them without keeping the link alive.)"""
    if group.broken is not None or channel.broken is not None or not channel.connected:
        return False
    try:
        channel.shutdown()
        return True
    except TensorParallelError:
        return False


def abort_groups(group: TPGroup, channel: CommandChannel) -> None:
    """Give up both groups' connections; never raises."""
    channel.abort()
    group.abort()
