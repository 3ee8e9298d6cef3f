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
import sys
import traceback
from dataclasses import dataclass

import torch
import torch.distributed as dist

from specdec.cache.kv_pool import KVPool
from specdec.checkpoint.loader import load_model
from specdec.distributed.channel import WORKER_IDLE_TIMEOUT_S, CommandChannel
from specdec.distributed.comm import TPGroup
from specdec.distributed.payload import CompactHeader, ForwardHeader, ShutdownHeader, unpack_forward
from specdec.model.config import ModelConfig
from specdec.model.llama import LlamaForCausalLM

SHUTDOWN = "shutdown"  # through the pipe of a spawned worker, before it connected
CONNECT = "connect"


@dataclass(frozen=True)
class ModelSpec:
    """One model every rank shards (the target, and the draft under ``draft_tensor_parallel_size == N``), as
    ``load_model`` takes it: every rank loads the same description, so rank 0 and the workers hold shards of the
    same (quantised) model.

    ``quantization`` / ``quantization_group_size`` / ``quantize_lm_head`` / ``gguf_path``: as ``load_model``'s
    (each rank quantises its own slices). ``shares_embedding_of``: the index (in the engine's list of models) of an
    earlier model whose embedding shard this one uses instead of reading its own - a ``draft_model="self"`` draft
    shares the target's on every rank, and its LM head too when tied and not quantised on its own
    (``quantize_lm_head`` not True), as the one-process self draft does."""

    path: str
    config: ModelConfig
    dtype: torch.dtype
    max_positions: int
    num_blocks: int
    block_size: int
    prepack_weights: bool | None
    quantization: str | None = None
    quantization_group_size: int | None = None
    quantize_lm_head: bool | None = None
    gguf_path: str | None = None
    shares_embedding_of: int | None = None
    batch_invariant: bool | None = None  # as load_model's (each rank's arithmetic; the all-reduce order is not covered)


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


def load_shard_model(spec: ModelSpec, group: TPGroup, device: torch.device,
                     earlier: list[LlamaForCausalLM]) -> LlamaForCausalLM:
    """This rank's shard of ``spec``'s model (rank 0 and the workers alike); ``earlier``: this rank's shards of
    the models before it (``spec.shares_embedding_of`` indexes them). No collective: ``group`` may be unconnected."""
    owner = earlier[spec.shares_embedding_of] if spec.shares_embedding_of is not None else None
    model = load_model(spec.path, spec.dtype, device, spec.max_positions, spec.config, spec.prepack_weights,
                       spec.quantization, spec.quantization_group_size, spec.gguf_path,
                       owner.embed_tokens.weight if owner is not None else None, group=group,
                       quantize_lm_head=spec.quantize_lm_head, batch_invariant=spec.batch_invariant)
    if owner is not None and spec.config.tie_word_embeddings and not spec.quantize_lm_head:
        model.lm_head = owner.lm_head  # the tied head is the shared embedding's rows (and their packed copy)
    return model


def load_shards(specs: tuple[ModelSpec, ...] | list[ModelSpec], group: TPGroup,
                device: torch.device) -> list[tuple[LlamaForCausalLM, KVPool]]:
    """This rank's shard of every model in ``specs`` and its KV pool (this rank's kv heads), in order."""
    shards: list[tuple[LlamaForCausalLM, KVPool]] = []
    for spec in specs:
        model = load_shard_model(spec, group, device, [m for m, _ in shards])
        pool = KVPool(spec.config, spec.num_blocks, spec.block_size, spec.dtype, device, model.layout.num_kv_heads)
        shards.append((model, pool))
    return shards


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
        shards = load_shards(spec.models, group, device)
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
