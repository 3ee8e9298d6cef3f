"""A forward's metadata staged in one persistent host buffer and carried to the device in one copy.

The model runner packs every integer array a forward needs - token ids, positions, slot mapping, logits indices
(int64) and sequence lengths, cumulative query lengths, block tables (int32) - into consecutive 8-byte-aligned
sections of one byte buffer, fills them with numpy (no per-array tensor construction), and hands the model
views of it. On CUDA the host buffer is pinned and its used prefix goes to a persistent device buffer in one
non-blocking copy; on CPU the views are the host buffer itself, so there is no copy at all (the scheme of vLLM
v1's ``InputBatch`` / ``CpuGpuBuffer``). Both buffers grow geometrically when a forward needs more.

The views are valid until the next ``stage``: the next forward overwrites the buffer (the device side in stream
order, after the kernels that read it; the pinned host side only once the previous copy has landed).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

ALIGN = 8  # bytes: every section starts on an int64 boundary, so it can be viewed as int64 or int32
INITIAL_BYTES = 4096

_TORCH_DTYPE = {np.dtype(np.int64): torch.int64, np.dtype(np.int32): torch.int32}


class StagingBuffer:
    """One growable byte buffer on the host (pinned when ``device`` is CUDA) and, off the CPU, its device mirror.

    ``separate_device_buffer`` (default: ``device`` is not the CPU) stages through a second buffer on ``device``
    with one copy per forward; without it the device views are the host buffer itself (CPU: no copy)."""

    def __init__(self, device: torch.device | str, initial_bytes: int = INITIAL_BYTES,
                 separate_device_buffer: bool | None = None):
        self.device = torch.device(device)
        self.on_cuda = self.device.type == "cuda"
        self.separate = self.device.type != "cpu" if separate_device_buffer is None else separate_device_buffer
        self.capacity = 0  # bytes
        self.num_grows = 0  # how many times the buffers were reallocated (tests watch the geometric growth)
        self.num_copies = 0  # host-to-device copies made (one per to_device with a separate device buffer)
        self._host: torch.Tensor | None = None  # uint8 [capacity], pinned on CUDA
        self._device_buf: torch.Tensor | None = None  # uint8 [capacity] on the device (separate buffer only)
        self._copy_done = torch.cuda.Event() if self.on_cuda else None  # the last host-to-device copy
        # The current stage: runs of consecutive same-dtype sections (packed, each run 8-byte aligned) as
        # (first element, dtype, section sizes), and the host views handed out.
        self._runs: list[tuple[int, np.dtype, list[int]]] = []
        self._host_views: list[np.ndarray] = []
        self._used = 0
        self._grow(initial_bytes)

    def stage(self, sections: Sequence[tuple[int, type | np.dtype]]) -> list[np.ndarray]:
        """Lay out ``sections`` (``(numel, np.int64 | np.int32)`` each) and return writable host views, one
        per section, in order: fill them, then call :meth:`to_device`. Overwrites the previous stage."""
        runs: list[tuple[int, np.dtype, list[int]]] = []
        offset = 0  # bytes
        for numel, dtype in sections:
            dtype = np.dtype(dtype)
            if runs and runs[-1][1] == dtype:
                runs[-1][2].append(numel)
            else:
                offset = -(-offset // ALIGN) * ALIGN
                runs.append((offset // dtype.itemsize, dtype, [numel]))
            offset += numel * dtype.itemsize
        if self._copy_done is not None:
            self._copy_done.synchronize()  # the previous copy still reads the pinned buffer until it lands
        if offset > self.capacity:
            self._grow(max(2 * self.capacity, offset))
        self._runs, self._used = runs, offset
        views = []
        for first, dtype, sizes in runs:
            typed = self._host_typed[dtype]
            for numel in sizes:
                views.append(typed[first : first + numel])
                first += numel
        self._host_views = views
        return views

    def to_device(self) -> list[torch.Tensor]:
        """The staged sections as 1-D tensors on the device, one per section. With a separate device buffer
        (CUDA) this is the forward's one host-to-device copy (non-blocking, from pinned memory)."""
        if not self.separate:
            return [torch.from_numpy(v) for v in self._host_views]  # the host memory itself
        self._device_buf[: self._used].copy_(self._host[: self._used], non_blocking=True)
        self.num_copies += 1
        if self._copy_done is not None:
            self._copy_done.record()
        out: list[torch.Tensor] = []
        for first, dtype, sizes in self._runs:  # one slice and one split per run of same-dtype sections
            run = self._device_typed[dtype][first : first + sum(sizes)]
            out += run.split(sizes) if len(sizes) > 1 else [run]
        return out

    def _grow(self, nbytes: int) -> None:
        nbytes = -(-nbytes // ALIGN) * ALIGN
        self._host = torch.zeros(nbytes, dtype=torch.uint8, pin_memory=self.on_cuda)
        # The whole buffer viewed as each dtype once, so a section is one slice (runs start 8-byte aligned).
        host_np = self._host.numpy()
        self._host_typed = {d: host_np.view(d) for d in _TORCH_DTYPE}
        if self.separate:
            self._device_buf = torch.zeros(nbytes, dtype=torch.uint8, device=self.device)
            self._device_typed = {d: self._device_buf.view(t) for d, t in _TORCH_DTYPE.items()}
        self.capacity = nbytes
        self.num_grows += 1
