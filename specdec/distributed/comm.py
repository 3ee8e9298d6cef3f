"""The process group of one tensor-parallel engine and its collectives.

A group is built from a ``TCPStore`` (rank 0 hosts it) as a backend object of its own - ``ProcessGroupGloo`` on
CPU, ``ProcessGroupNCCL`` on CUDA - not as torch's default group: a process may then hold several engines one
after the other (tests do) and nothing global is left behind. Every collective waits at most ``timeout``
(``datetime.timedelta``): a rank that died fails the others' collective at once ("connection closed by peer"),
one that hangs fails it after the timeout. Either way the group is marked broken and every later call raises
``TensorParallelError`` immediately - after a failed collective the ranks no longer agree on what comes next.
"""

from __future__ import annotations

import datetime
import os

import torch
import torch.distributed as dist


class TensorParallelError(RuntimeError):
    """A collective of the tensor-parallel group failed (a worker died or hung), or the group is already broken."""


class TPGroup:
    """Rank ``rank`` of ``size`` in one engine's tensor-parallel group. Rank 0 is the driver (the engine's
    process)."""

    def __init__(self, rank: int, size: int, device: torch.device, timeout_s: float):
        self.rank = rank
        self.size = size
        self.device = device
        self.backend = "nccl" if device.type == "cuda" else "gloo"
        self.timeout = datetime.timedelta(seconds=timeout_s)
        self.pg: object | None = None  # the backend's process group, once ``connect`` returned
        self.broken: str | None = None  # why the group is unusable, once a collective failed

    def connect(self, store: dist.Store) -> None:
        """Join the group whose rendezvous is ``store`` (blocks until every rank joined, at most the store's
        timeout): gloo on CPU, NCCL on CUDA."""
        if self.backend == "nccl":
            # a collective's wait() then blocks the host and raises at the timeout (NCCL's default is to return at
            # once and let a watchdog tear the process down), so a dead or hung rank ends requests with an error, as
            # on gloo. NOTE: not yet run on GPUs (docs/tensor_parallel.md, "Faults")
            os.environ.setdefault("TORCH_NCCL_BLOCKING_WAIT", "1")
            opts = dist.ProcessGroupNCCL.Options()
            opts._timeout = self.timeout
            self.pg = dist.ProcessGroupNCCL(store, self.rank, self.size, opts)
        else:
            self.pg = dist.ProcessGroupGloo(store, self.rank, self.size, self.timeout)

    def _run(self, what: str, fn) -> None:
        if self.broken is not None or self.pg is None:
            state = f"broken ({self.broken})" if self.broken is not None else "not connected"
            raise TensorParallelError(f"the tensor-parallel group is {state}; restart the engine")
        try:
            fn().wait()
        except Exception as e:  # noqa: BLE001 - any backend failure breaks the group
            self.broken = f"{what} failed on rank {self.rank}: {type(e).__name__}: {str(e)[:300]}"
            raise TensorParallelError(f"a tensor-parallel worker died or hung ({self.broken}; timeout "
                                      f"{self.timeout.total_seconds():g} s)") from e

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum ``x`` (any shape, contiguous) over the ranks, in place; returns ``x``."""
        self._run("all-reduce", lambda: self.pg.allreduce([x]))
        return x

    def broadcast(self, x: torch.Tensor) -> torch.Tensor:
        """Rank 0's ``x`` into every rank's ``x`` (same shape and dtype everywhere), in place; returns ``x``."""
        self._run("broadcast", lambda: self.pg.broadcast(x, 0))
        return x

    def gather_last_dim(self, x: torch.Tensor) -> torch.Tensor | None:
        """Every rank's ``x [..., n]`` concatenated along the last dim on rank 0 (``[..., size * n]``, rank order);
        None on the other ranks."""
        x = x.contiguous()
        if self.rank == 0:
            parts = [torch.empty_like(x) for _ in range(self.size)]
            opts = dist.GatherOptions()
            opts.rootRank = 0
            self._run("gather", lambda: self.pg.gather([parts], [x], opts))
            return torch.cat(parts, dim=-1)
        opts = dist.GatherOptions()
        opts.rootRank = 0
        self._run("gather", lambda: self.pg.gather([], [x], opts))
        return None

    def abort(self) -> None:
        """Give up the group's connections (after a failure, or at shutdown) and release the backend object, so
        that it is destroyed now - its threads joined, its sockets closed - and not at interpreter exit: a gloo
        group still alive then aborts the process ("terminate called without an active exception"; seen under
        torchrun, where every rank's interpreter exits normally). Never raises."""
        self.broken = self.broken or "shut down"
        pg, self.pg = self.pg, None
        if pg is None:
            return
        for name in ("abort", "shutdown"):
            fn = getattr(pg, name, None)
            if fn is not None:
                try:
                    fn()
                    break
                except Exception:  # noqa: BLE001, S110 - best effort on the way out
                    pass
