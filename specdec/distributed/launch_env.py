"""Whether this process was started by ``torchrun`` (or another launcher of torch's ``env://`` contract), and what
an engine may ask of such a launch.

``torchrun`` sets ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR`` and ``MASTER_PORT`` in every process
it starts; with all five set, every rank runs one shard of one engine (``torchrun.py``): rank 0 drives it, the
others serve, and ``tensor_parallel_size`` must be ``WORLD_SIZE``. Without them the engine spawns its own workers
(``launcher.py``).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")


@dataclass(frozen=True)
class LaunchEnv:
    """This process's place in a ``torchrun`` launch."""

    rank: int  # global rank: 0 drives the engine, the others serve
    world_size: int
    local_rank: int  # rank on this node: the CUDA device this rank uses
    master_addr: str  # the rendezvous store (``torch.distributed.rendezvous("env://")``)
    master_port: int

    @classmethod
    def from_environ(cls, environ: dict[str, str] | None = None) -> LaunchEnv | None:
        """The launch ``environ`` (default ``os.environ``) describes, or None when it names none (not every one of
        the five variables is set). ``ValueError`` when they are set but malformed."""
        environ = os.environ if environ is None else environ
        if not all(environ.get(v) for v in _VARS):
            return None
        try:
            env = cls(int(environ["RANK"]), int(environ["WORLD_SIZE"]), int(environ["LOCAL_RANK"]),
                      environ["MASTER_ADDR"], int(environ["MASTER_PORT"]))
        except ValueError:
            raise ValueError("RANK, WORLD_SIZE, LOCAL_RANK and MASTER_PORT must be integers (as torchrun sets them), "
                             f"got {[environ[v] for v in _VARS]}") from None
        if not 0 <= env.rank < env.world_size or env.local_rank < 0:
            raise ValueError(f"RANK={env.rank} must lie in [0, WORLD_SIZE={env.world_size}) and LOCAL_RANK="
                             f"{env.local_rank} must be >= 0 (as torchrun sets them)")
        return env

    @property
    def is_driver(self) -> bool:
        return self.rank == 0

    def device(self, device_type: str) -> torch.device:
        """This rank's device: ``cuda:LOCAL_RANK`` on CUDA, else the CPU."""
        return torch.device("cuda", self.local_rank) if device_type == "cuda" else torch.device("cpu")


def check_launch(tensor_parallel_size: int, device: torch.device, environ: dict[str, str] | None = None) -> None:
    """``ValueError`` saying what is allowed when this process was started by ``torchrun`` and an engine of
    ``tensor_parallel_size`` ranks on ``device`` cannot run in its launch: one engine over every rank, so the size
    must be ``WORLD_SIZE``, and on CUDA each node needs a device per local rank. ``tensor_parallel_size == 1`` is
    not a tensor-parallel launch: every process runs its own one-process engine (data-parallel replicas under
    ``torchrun``, a DDP or SLURM job), so nothing is checked."""
    env = LaunchEnv.from_environ(environ)
    if env is None or tensor_parallel_size == 1:
        return
    if tensor_parallel_size != env.world_size:
        raise ValueError(
            f"this process was started by torchrun with WORLD_SIZE={env.world_size}: every rank holds one shard of "
            f"one engine, so tensor_parallel_size must be {env.world_size}, got {tensor_parallel_size} (or run "
            "without torchrun: then the engine spawns its own workers)")
    if device.type == "cuda" and env.local_rank >= torch.cuda.device_count():
        raise ValueError(f"rank {env.rank} has LOCAL_RANK={env.local_rank} and uses cuda:{env.local_rank}, but torch "
                         f"sees {torch.cuda.device_count()} CUDA device(s) on this node: start at most that many "
                         "processes per node (torchrun --nproc-per-node)")
