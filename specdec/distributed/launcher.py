"""Starting, watching and stopping the workers the engine spawns itself (``torchrun.py``: when ``torchrun``
started every rank).

The engine's process is rank 0 (the driver); ranks 1..N-1 are processes it spawns with torch's multiprocessing
(the ``spawn`` method: a fresh interpreter - CUDA cannot be used in a forked child - that imports only what
``worker.run_worker`` needs). Each gets a pipe for the start-up handshake and joins the collectives' group
through a ``TCPStore`` rank 0 hosts on a free port of 127.0.0.1. Start-up: spawn -> every rank loads its shards
(workers report "ready" or their error through the pipe, while rank 0 loads its own) -> "connect" -> the groups
form. A worker that fails to load is reported with its traceback before any collective is attempted. From then
on the driver's commands travel over the command channel (``channel.py``), as under ``torchrun``.
"""

from __future__ import annotations

import atexit
import datetime
import weakref

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from specdec.distributed.channel import CommandChannel
from specdec.distributed.comm import TensorParallelError, TPGroup
from specdec.distributed.driver_link import DriverLink, abort_groups, stop_serving
from specdec.distributed.payload import Header
from specdec.distributed.worker import CONNECT, SHUTDOWN, ModelSpec, WorkerSpec, run_worker

STARTUP_POLL_S = 0.5  # how often start-up checks that a loading worker is still alive (a blocking wait, not a spin)
SHUTDOWN_GRACE_S = 5.0  # how long a healthy worker gets to exit before it is killed


class TensorParallelWorkers(DriverLink):
    """The spawned workers of one engine and rank 0's end (``DriverLink``: ``shards``, ``send``). ``shutdown()``
    (also run when this object is collected, and at interpreter exit) never hangs."""

    def __init__(self, size: int, device: torch.device, timeout_s: float, models: list[ModelSpec],
                 startup_timeout_s: float = 600.0):
        super().__init__(size, device, timeout_s, models)
        self.procs: list = []
        self.conns: list = []
        self._finalizer = weakref.finalize(self, _stop, self.procs, self.conns, self.group, self.channel, False)
        # NOTE: also at exit, before multiprocessing's own exit hook (registered earlier, so run later), which would
        # wait forever for a stopped worker after sending it SIGTERM
        atexit.register(self._finalizer)
        try:
            self._start(timeout_s, startup_timeout_s)
        except BaseException:
            self.shutdown()
            raise

    def _start(self, timeout_s: float, startup_timeout_s: float) -> None:
        size = self.size
        store = dist.TCPStore("127.0.0.1", 0, size, True, timeout=datetime.timedelta(seconds=max(timeout_s, 30.0)),
                              wait_for_workers=False)
        ctx = mp.get_context("spawn")
        for rank in range(1, size):
            spec = WorkerSpec(rank, size, "127.0.0.1", store.port, self.device.type, timeout_s,
                              torch.get_num_threads(), self.models)
            parent, child = ctx.Pipe()
            proc = ctx.Process(target=run_worker, args=(spec, child), daemon=True, name=f"specdec-tp-rank{rank}")
            proc.start()
            child.close()
            self.procs.append(proc)
            self.conns.append(parent)
        self.load_shards()
        self._wait_ready(startup_timeout_s)
        for conn in self.conns:
            conn.send(CONNECT)
        self.connect(store)
        self._store = store  # kept alive: the workers' rendezvous

    def _wait_ready(self, timeout_s: float) -> None:
        """Every worker's "ready", or ``RuntimeError`` with the first failure (its traceback, or its exit code)."""
        waited = 0.0
        for rank, (proc, conn) in enumerate(zip(self.procs, self.conns), start=1):
            while not conn.poll(STARTUP_POLL_S):
                waited += STARTUP_POLL_S
                if not proc.is_alive():
                    raise RuntimeError(f"tensor-parallel worker rank {rank} exited with code {proc.exitcode} while "
                                       "loading its shard (its stderr says why)")
                if waited > timeout_s:
                    raise RuntimeError(f"tensor-parallel worker rank {rank} did not load its shard in {timeout_s} s")
            try:
                status, message = conn.recv()
            except EOFError:
                status, message = "error", f"exit code {proc.join(5) or proc.exitcode}"
            if status != "ready":
                raise RuntimeError(f"tensor-parallel worker rank {rank} failed to start:\n{message}")

    @property
    def error(self) -> str | None:
        """Why the group cannot run another forward (a worker gone, a failed collective), or None while healthy."""
        for rank, proc in enumerate(self.procs, start=1):
            if proc.exitcode is not None:
                return f"tensor-parallel worker rank {rank} (pid {proc.pid}) exited with code {proc.exitcode}"
        return super().error

    def send(self, header: Header, payload: torch.Tensor | None = None) -> None:
        """``DriverLink.send``, after checking that no worker process has exited (the group marked broken if one
        has)."""
        error = self.error
        if error is not None:
            self.group.broken = self.group.broken or error
            raise TensorParallelError(f"a tensor-parallel worker died or hung ({error}); restart the engine")
        super().send(header, payload)

    def shutdown(self) -> None:
        """Stop every worker: ask, wait up to ``SHUTDOWN_GRACE_S`` (none when the group is broken - a hung worker
        would not answer), then kill what is left. Idempotent; never raises."""
        self._finalizer.detach()
        _stop(self.procs, self.conns, self.group, self.channel, self.error is None)


def _stop(procs: list, conns: list, group: TPGroup, channel: CommandChannel, graceful: bool) -> None:
    # workers in their serve loop are asked over the channel - unless one has exited: a broadcast to it could then
    # wait up to the collectives' timeout, and the others are killed below anyway
    asked = all(proc.exitcode is None for proc in procs) and stop_serving(group, channel)
    for conn in conns:
        if not asked:  # workers still starting up, waiting for CONNECT
            try:
                conn.send(SHUTDOWN)
            except (OSError, ValueError):
                pass
    for proc in procs:
        if graceful:
            proc.join(SHUTDOWN_GRACE_S)
        if proc.is_alive():
            proc.kill()  # SIGKILL: also ends a stopped or hung process
            proc.join(SHUTDOWN_GRACE_S)
    for conn in conns:
        conn.close()
    abort_groups(group, channel)
