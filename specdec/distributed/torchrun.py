"""Tensor parallelism under ``torchrun``: every rank runs the user's script, and ``LLM(..., tensor_parallel_size=
WORLD_SIZE)`` builds the engine on rank 0 (``TorchrunDriver``) and serves it on the others (``serve_as_worker``).

The rendezvous is torch's ``env://`` one (``torch.distributed.rendezvous``, as ``init_process_group`` does):
under ``torchrun`` every rank is a client of the agent's store at ``MASTER_ADDR:MASTER_PORT``
(``TORCHELASTIC_USE_AGENT_STORE=True``); without an agent store rank 0 hosts it there. The engine's keys live
under a prefix of their own. Start-up: rank 0 publishes what every rank loads (``ModelSpec``s: the pool's block
count is rank 0's) -> every rank loads its shards -> the groups form (every rank waits for the others at most
the start-up timeout). From then on it is the spawned engine's protocol: commands over the command channel,
compute over the group. The processes are ``torchrun``'s: a rank that fails makes its agent stop the others.

A worker's ``LLM(...)`` call does not return: it serves until rank 0 shuts the engine down, then ends the
process with ``SystemExit(0)`` (so one script runs unchanged on every rank - what follows ``LLM(...)`` runs on
rank 0 only), or raises ``TensorParallelError`` when rank 0 is gone. Hence one engine per launch: a second
``LLM(tensor_parallel_size=N)`` on rank 0 is refused (its workers have left).
"""

from __future__ import annotations

import atexit
import dataclasses
import datetime
import pickle
import weakref
from typing import NoReturn

import torch
import torch.distributed as dist

from specdec.distributed.channel import WORKER_IDLE_TIMEOUT_S, CommandChannel
from specdec.distributed.comm import TensorParallelError, TPGroup
from specdec.distributed.driver_link import DriverLink, abort_groups, stop_serving
from specdec.distributed.launch_env import LaunchEnv
from specdec.distributed.worker import ModelSpec, connect, load_shards, serve

STARTUP_TIMEOUT_S = 600.0  # how long a rank waits for the others to load and join
_STORE_PREFIX = "specdec-tp/"
_MODELS_KEY = "models"
_engine_started = False  # this process has built its launch's engine (rank 0) - one per launch


def rendezvous_store(timeout_s: float) -> dist.Store:
    """The launch's store, as ``torch.distributed``'s ``env://`` rendezvous builds it (a client of the agent's
    store, or hosted by rank 0), under the engine's prefix; its waits last at most ``timeout_s``."""
    store, _, _ = next(dist.rendezvous("env://", timeout=datetime.timedelta(seconds=timeout_s)))
    return dist.PrefixStore(_STORE_PREFIX, store)


class TorchrunDriver(DriverLink):
    """Rank 0 of a ``torchrun`` launch: loads its shards and forms the groups with ranks 1..N-1, which run
    ``serve_as_worker``. ``procs`` is empty (the processes are ``torchrun``'s). ``shutdown()`` (also run when this
    object is collected, and at interpreter exit) sends the workers away; it never hangs."""

    def __init__(self, env: LaunchEnv, device: torch.device, timeout_s: float, models: list[ModelSpec],
                 startup_timeout_s: float = STARTUP_TIMEOUT_S):
        global _engine_started
        if _engine_started:
            raise RuntimeError("under torchrun a launch runs one tensor-parallel engine: the other ranks left when "
                               "the first one shut down; start a new launch for another engine")
        _engine_started = True
        if device.type == "cuda":
            torch.cuda.set_device(device)
        super().__init__(env.world_size, device, timeout_s, models)
        self.procs: list = []
        self._finalizer = weakref.finalize(self, _stop, self.group, self.channel)
        atexit.register(self._finalizer)  # tell the workers at exit, however rank 0's script ends
        try:
            store = rendezvous_store(startup_timeout_s)
            store.set(_MODELS_KEY, pickle.dumps(self.models))
            self.load_shards()
            self.connect(store)
            self._store = store
        except BaseException:
            self.shutdown()
            raise

    def shutdown(self) -> None:
        """Send the workers out of their serve loop (unless the group is broken: a worker may be hung) and give
        up the connections. Idempotent; never raises."""
        self._finalizer.detach()
        _stop(self.group, self.channel)


def _stop(group: TPGroup, channel: CommandChannel) -> None:
    stop_serving(group, channel)
    abort_groups(group, channel)


def serve_as_worker(env: LaunchEnv, device_type: str, timeout_s: float, models: list[ModelSpec],
                    startup_timeout_s: float = STARTUP_TIMEOUT_S) -> NoReturn:
    """Rank ``env.rank`` >= 1: load this rank's shards of ``models`` (this rank's own specs - its paths - with rank
    0's pool sizes), join the groups, serve rank 0 until it shuts down, then ``SystemExit(0)``.
    ``TensorParallelError`` when rank 0 is gone (or a collective failed); ``RuntimeError`` when this rank was
    started with other arguments than rank 0."""
    device = env.device(device_type)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    group = TPGroup(env.rank, env.world_size, device, timeout_s)
    channel = CommandChannel(env.rank, env.world_size, group, WORKER_IDLE_TIMEOUT_S)
    try:
        store = rendezvous_store(startup_timeout_s)
        models = _agree(models, pickle.loads(store.get(_MODELS_KEY)), env.rank)  # waits for rank 0
        shards = load_shards(models, group, device)
        connect(group, channel, store)
        serve(channel, shards)
    except TensorParallelError as e:
        why = channel.broken or group.broken or str(e)
        raise TensorParallelError(f"tensor-parallel rank {env.rank} lost the driver (rank 0) or another rank "
                                  f"({why})") from e
    finally:
        abort_groups(group, channel)
    raise SystemExit(0)


def _agree(mine: list[ModelSpec], driver: tuple[ModelSpec, ...], rank: int) -> list[ModelSpec]:
    """This rank's specs with rank 0's pool sizes (its block count is the one the block tables index), or
    ``RuntimeError`` when anything else but the paths differs (the ranks were started with other arguments)."""
    agreed = [dataclasses.replace(m, num_blocks=d.num_blocks) for m, d in zip(mine, driver)]
    if len(mine) != len(driver) or any(dataclasses.replace(a, path=d.path) != d for a, d in zip(agreed, driver)):
        raise RuntimeError(f"rank {rank} was started with other LLM(...) arguments than rank 0 (the models to shard "
                           "differ): every rank must run the same script with the same arguments")
    return agreed
