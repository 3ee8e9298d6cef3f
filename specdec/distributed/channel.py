"""The driver's commands to the workers: one broadcast of a fixed-size int64 message per command, over a gloo
group of its own.

Every launch mode uses it (the engine's spawned workers and ``torchrun``'s ranks alike): the message is
``[inline, header (payload.HEADER_LEN ints), inline room (INLINE_CAPACITY ints)]``. A payload that lies on the
host and fits the room travels inside the message (``inline = 1``: one collective per forward, as cheap as the
pipe header it replaced on this CPU); a bigger one, or one on a GPU, follows as a broadcast on the engine's
compute group (``TPGroup``: NCCL on CUDA), which a worker allocates from the header's sizes.

The control group is gloo on the CPU whatever the device (the header is needed on the host to allocate), and its
timeout differs by side: the driver's is the collectives' timeout (a send never hangs), a worker's is
``WORKER_IDLE_TIMEOUT_S`` - between steps a worker waits in this broadcast for as long as the engine is idle. It
waits there on a blocking socket read, not by polling, and learns of the driver's death from its connection
closing: the broadcast fails at once and the worker ends.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from specdec.distributed.comm import TPGroup
from specdec.distributed.payload import HEADER_LEN, Header, ShutdownHeader, header_from_ints, header_to_ints

INLINE_CAPACITY = 1024  # payload ints carried inside the message (8 KiB): a decode of ~8 sequences x 64 blocks
WORKER_IDLE_TIMEOUT_S = 10 * 365 * 86400.0  # how long a worker waits for the next command: no practical limit
_STORE_PREFIX = "specdec-control/"  # the control group's keys in the rendezvous store (the compute group's: none)


class CommandChannel:
    """Rank ``rank``'s end of the driver's command channel; ``compute`` is the engine's group (where payloads
    that do not travel inline are broadcast). ``timeout_s``: how long this rank's control broadcasts wait."""

    def __init__(self, rank: int, size: int, compute: TPGroup, timeout_s: float):
        self.control = TPGroup(rank, size, torch.device("cpu"), timeout_s)  # gloo
        self.compute = compute
        self.message = torch.zeros(1 + HEADER_LEN + INLINE_CAPACITY, dtype=torch.int64)  # reused: one at a time
        self._ints = self.message.numpy()
        self.inline_limit = INLINE_CAPACITY  # rank 0: the biggest payload sent inline (tests lower it)

    def connect(self, store: dist.Store) -> None:
        """Join the control group whose rendezvous is ``store`` (keys under their own prefix)."""
        self.control.connect(dist.PrefixStore(_STORE_PREFIX, store))

    @property
    def connected(self) -> bool:
        return self.control.pg is not None

    @property
    def broken(self) -> str | None:
        """Why a command could not be sent or received (``TPGroup.broken`` of the control group), or None."""
        return self.control.broken

    def send(self, header: Header, payload: torch.Tensor | None = None) -> None:
        """Rank 0: ``header`` and its payload (int64 ``[header.numel]``, any device) to every worker;
        ``TensorParallelError`` if a worker is gone (or the group is broken)."""
        n = header.numel
        assert (payload.numel() if payload is not None else 0) == n, "the payload does not match its header"
        inline = payload is None or (payload.device.type == "cpu" and n <= min(self.inline_limit, INLINE_CAPACITY))
        self._ints[0] = int(inline)
        self._ints[1 : 1 + HEADER_LEN] = header_to_ints(header)
        if inline and n:
            self.message[1 + HEADER_LEN : 1 + HEADER_LEN + n].copy_(payload)
        self.control.broadcast(self.message)
        if not inline:
            self.compute.broadcast(payload)

    def shutdown(self) -> None:
        """Rank 0: tell the workers to leave their serve loop."""
        self.send(ShutdownHeader())

    def recv(self) -> tuple[Header, torch.Tensor]:
        """A worker: the next command's header and payload (int64 ``[header.numel]`` on the compute group's
        device; an inline one is a view of the message, valid until the next ``recv``). Blocks until the driver
        sends; ``TensorParallelError`` if the driver is gone."""
        self.control.broadcast(self.message)
        header = header_from_ints(self._ints[1 : 1 + HEADER_LEN].tolist())
        n = header.numel
        if self._ints[0]:
            return header, self.message[1 + HEADER_LEN : 1 + HEADER_LEN + n].to(self.compute.device)
        payload = torch.empty(n, dtype=torch.int64, device=self.compute.device)
        return header, self.compute.broadcast(payload)

    def abort(self) -> None:
        """Give up the control group's connections; never raises."""
        self.control.abort()
