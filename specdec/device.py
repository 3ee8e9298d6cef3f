"""Transfers between host and device that do not stall the host: :func:`to_device` (host to device) and
:class:`StepOutput` (the engine step's one device-to-host read).

On CUDA, ``torch.tensor(list, device="cuda")`` and ``.to("cuda")`` of a pageable CPU tensor copy through a staging
buffer and synchronise the stream: the host waits for the GPU to drain its queue, on every small index or
settings tensor of a step. :func:`to_device` copies from pinned memory with ``non_blocking=True`` instead, so the
host keeps queueing work (PyTorch's caching host allocator keeps the pinned block alive until the copy has run).
On every other device it builds the tensor exactly as ``torch.tensor`` / ``torch.from_numpy`` would.
"""

from __future__ import annotations

import numpy as np
import torch


def to_device(data, dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
    """``data`` (a list, a numpy array or a CPU tensor) as a ``dtype`` tensor on ``device``.

    On CPU a numpy array is shared, not copied (``torch.from_numpy``), and a list is copied (``torch.tensor``), as
    before; on CUDA the copy goes through pinned host memory and does not synchronise the stream."""
    device = torch.device(device)
    if isinstance(data, torch.Tensor):
        host = data.to(dtype)
    elif isinstance(data, np.ndarray):
        host = torch.from_numpy(data).to(dtype)
    else:
        host = torch.tensor(data, dtype=dtype)
    if device.type != "cuda":
        return host.to(device)
    return host.pin_memory().to(device, non_blocking=True)


class StepOutput:
    """Device vectors gathered during a step, read to the host together: the one host read of an engine step.

    Everything a step must bring back to the host - the plain rows' sampled tokens, verification's emitted tokens and
    accepted counts, drafts still on the device, the NaN/inf flags of every logits row - is registered here as
    device vectors while the step queues its work, and read in **one** device-to-host copy at the end
    (``torch.cat(...).tolist()``). Each consumer keeps the handle :meth:`add` gave it and takes its slice back with
    :meth:`get` after :meth:`read`. Nothing is read before :meth:`read`, so the host never waits on the device in
    the middle of a step (docs/architecture.md, "Host reads").
    """

    def __init__(self):
        self._parts: list[torch.Tensor] = []  # 1-D, cast to int64 at read
        self._bounds: list[tuple[int, int]] = []  # per part: its [start, end) in the flat host list
        self._size = 0
        self._host: list[int] | None = None

    def add(self, values: torch.Tensor) -> int:
        """Register ``values`` (1-D integer or bool, on the device) for the read; returns its handle."""
        if self._host is not None:
            raise RuntimeError("StepOutput.add after read(): the step's host read has been made")
        if values.dim() != 1:
            raise ValueError(f"StepOutput takes 1-D vectors, got shape {tuple(values.shape)}")
        self._parts.append(values)
        self._bounds.append((self._size, self._size + values.shape[0]))
        self._size += values.shape[0]
        return len(self._parts) - 1

    def read(self) -> None:
        """The step's one host read (no-op for an empty step)."""
        if self._host is not None:
            return
        if not self._parts:
            self._host = []
            return
        parts = [p if p.dtype == torch.int64 else p.long() for p in self._parts]
        self._host = (parts[0] if len(parts) == 1 else torch.cat(parts)).tolist()

    def get(self, handle: int) -> list[int]:
        """The host copy of the vector registered as ``handle`` (after :meth:`read`)."""
        if self._host is None:
            raise RuntimeError("StepOutput.get before read()")
        start, end = self._bounds[handle]
        return self._host[start:end]
