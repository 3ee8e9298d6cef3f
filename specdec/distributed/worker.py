"""A tensor-parallel worker (ranks >= 1): load this rank's shards, join the group, then run what the driver sends.

``serve`` is the loop of every launch mode: it blocks in the command channel's broadcast (``channel.py``: a
blocking read with no practical timeout, not a poll) until the driver's next command - a forward or a KV
compaction of model ``model_id``, or shutdown. Between steps a worker is idle there for as long as the engine
is, so the collectives' timeout bounds only the work of one forward. The driver's death closes the connection
and ends the worker (``TensorParallelError``); so does any failure - the ranks no longer agree after one, and the
driver sees its next collective fail.

``run_worker`` is the entry of a worker the engine spawned (``launcher.py``): its pipe carries only the start-up
handshake. ``torchrun.py`` has the entry of a worker ``torchrun`` started.
"""

from __future__ import annotations

import datetime
import logging
import sys
import traceback
from dataclasses import dataclass

import torch
import torch.distributed as dist

from specdec.cache.kv_pool import KVPool
from specdec.distributed.channel import WORKER_IDLE_TIMEOUT_S, CommandChannel
from specdec.distributed.comm import TPGroup
from specdec.distributed.payload import CompactHeader, ForwardHeader, ShutdownHeader, unpack_forward
from specdec.model.config import ModelConfig
from specdec.model.llama import LlamaForCausalLM
from specdec.model.loader import load_model

logger = logging.getLogger(__name__)

SHUTDOWN = "shutdown"  # through the pipe of a spawned worker, before it connected
CONNECT = "connect"


@dataclass(frozen=True)
class ModelSpec:
    """One model every rank shards (the target, and the draft under ``draft_tensor_parallel_size == N``)."""

    path: str
    config: ModelConfig
    dtype: torch.dtype
    max_positions: int
    num_blocks: int
    block_size: int
    prepack_weights: bool | None


@dataclass(frozen=True)
class WorkerSpec:
    rank: int
    size: int
    store_host: str
    store_port: int
    device_type: str  # "cpu" (gloo) or "cuda" (NCCL; rank r on cuda:r)
    timeout_s: float
    num_threads: int
    models: tuple[ModelSpec, ...]


def load_shard(spec: ModelSpec, group: TPGroup, device: torch.device) -> tuple[LlamaForCausalLM, KVPool]:
    """This rank's shard of ``spec``'s model and its KV pool (this rank's kv heads)."""
    model = load_model(spec.path, spec.dtype, device, spec.max_positions, spec.config, spec.prepack_weights,
                       group=group)
    pool = KVPool(spec.config, spec.num_blocks, spec.block_size, spec.dtype, device, model.layout.num_kv_heads)
    return model, pool


def run_worker(spec: WorkerSpec, conn) -> None:
    """The process entry of rank ``spec.rank`` (spawned by ``launcher.py``). Reports ("ready", None) or ("error",
    traceback) through ``conn`` after loading, waits for ``CONNECT``, then serves until the driver's shutdown."""
    torch.set_num_threads(spec.num_threads)
    device = torch.device(f"cuda:{spec.rank}") if spec.device_type == "cuda" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    group = TPGroup(spec.rank, spec.size, device, spec.timeout_s)
    channel = CommandChannel(spec.rank, spec.size, group, WORKER_IDLE_TIMEOUT_S)
    try:
        shards = [load_shard(m, group, device) for m in spec.models]
        conn.send(("ready", None))
        if conn.recv() != CONNECT:
            return
        store = dist.TCPStore(spec.store_host, spec.store_port, spec.size, False,
                              timeout=datetime.timedelta(seconds=max(spec.timeout_s, 30.0)))
        connect(group, channel, store)
        serve(channel, shards)
    except EOFError:
        pass  # the driver is gone before the group formed
    except BaseException:  # noqa: BLE001 - reported, then the process ends (the driver's collectives fail)
        message = traceback.format_exc()
        print(f"specdec tensor-parallel worker rank {spec.rank} failed:\n{message}", file=sys.stderr, flush=True)
        try:
            conn.send(("error", message))
        except OSError:
            pass
    finally:
        channel.abort()
        group.abort()


def connect(group: TPGroup, channel: CommandChannel, store: dist.Store) -> None:
    """Join the compute group and the command channel (the driver's ``DriverLink.connect``, in the same order)."""
    group.connect(store)
    channel.connect(store)


def serve(channel: CommandChannel, shards: list[tuple[LlamaForCausalLM, KVPool]]) -> None:
    """Run every forward / compaction the driver sends until its shutdown; ``TensorParallelError`` if the driver
    is gone (or a collective failed)."""
    while True:
        header, payload = channel.recv()
        if isinstance(header, ShutdownHeader):
            return
        if isinstance(header, ForwardHeader):
            model, pool = shards[header.model_id]
            ids, positions, meta, logits_indices = unpack_forward(header, payload)
            model(ids, positions, pool.tensors, meta, logits_indices)  # returns None off rank 0
        elif isinstance(header, CompactHeader):
            _, pool = shards[header.model_id]
            pool.compact(payload[: header.num_moves], payload[header.num_moves :])
