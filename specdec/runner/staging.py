"""A forward's metadata staged in persistent host buffers and carried to the device in one copy.

The model runner packs every array a forward needs - token ids, positions, slot mapping, logits indices (int64),
sequence lengths, cumulative query lengths, block tables, tree-mask offsets (int32) and the packed tree masks
(bool) - into consecutive 8-byte-aligned sections of one byte buffer, fills them with numpy (no per-array tensor
construction), and hands the model views of it. On CUDA the host buffer is pinned and its used prefix goes to a
persistent device buffer in one non-blocking copy; on CPU the views are the host buffer itself, so there is no
copy at all (the scheme of vLLM v1's ``InputBatch`` / ``CpuGpuBuffer``). The buffers grow geometrically when a
forward needs more.

Several host slots (``num_slots``, default 2), used in turn. A non-blocking copy reads its pinned source when the
stream reaches it, so a slot may be rewritten only once the copy made from it has landed: each slot has its own
copy-done event, and ``stage`` waits only for the event of the slot it is about to fill - with two slots, the
copy made two forwards ago. With one slot the host had to wait for the previous forward's copy, which is queued
behind that forward's predecessor's kernels, before it could even stage the next forward: it ran at most one
forward ahead of the GPU. With two it runs up to two ahead, and in the engine's steady state (a step ends in its
host read) the slot it reuses is long free.

One device buffer is enough: the copy into it is issued on the same stream as the forward that reads the views
(the current stream), so the next forward's copy is ordered after every kernel of this forward that reads them.
Callers keep that rule: a forward's device views are read by kernels issued on the current stream before the next
``to_device``. A growth of the device buffer frees the old one to the caching allocator, which reuses it only
for work ordered after what is already queued on the stream; a slot's old pinned memory stays alive until the copy
made from it has run (PyTorch's caching host allocator records the copy).

What callers may rely on: a stage's views are valid until the next ``stage`` (host views, CPU) / the next
``to_device`` in stream order (device views). In fact the host views of a stage survive ``num_slots - 1`` further
stages (tests check that staging forward N + 1 leaves forward N's host memory alone).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

ALIGN = 8  # bytes: every run of sections starts on an int64 boundary, so it can be viewed as any of the dtypes
INITIAL_BYTES = 4096
NUM_SLOTS = 2  # host slots used in turn: a stage waits for the copy made num_slots forwards ago

_TORCH_DTYPE = {np.dtype(np.int64): torch.int64, np.dtype(np.int32): torch.int32, np.dtype(np.bool_): torch.bool,
                np.dtype(np.uint8): torch.uint8}  # fmt: skip


class StagingBuffer:
    """``num_slots`` growable byte buffers on the host (pinned when ``device`` is CUDA), used in turn, and, off the
    CPU, one device buffer they are copied into.

    ``separate_device_buffer`` (default: ``device`` is not the CPU) stages through the device buffer with one copy
    per forward; without it the device views are the host slot itself (CPU: no copy).

    Counters (tests and benchmarks read them): ``num_grows`` - times the capacity grew (the first allocation
    included); ``num_copies`` - host-to-device copies; ``num_waits`` - stages that found their slot's copy not yet
    landed and waited for it (CUDA only)."""

    def __init__(self, device: torch.device | str, initial_bytes: int = INITIAL_BYTES,
                 separate_device_buffer: bool | None = None, num_slots: int = NUM_SLOTS):
        if not isinstance(num_slots, int) or num_slots < 1:
            raise ValueError(f"num_slots must be an integer >= 1, got {num_slots!r}")
        self.device = torch.device(device)
        self.on_cuda = self.device.type == "cuda"
        self.separate = self.device.type != "cpu" if separate_device_buffer is None else separate_device_buffer
        self.num_slots = num_slots
        self.capacity = 0  # bytes: the size of the device buffer; a slot smaller than this is reallocated when used
        self.num_grows = 0
        self.num_copies = 0
        self.num_waits = 0
        self._hosts: list[torch.Tensor | None] = [None] * num_slots  # uint8 [<= capacity] each, pinned on CUDA
        self._host_typed: list[dict[np.dtype, np.ndarray]] = [{} for _ in range(num_slots)]  # each slot per dtype
        # per slot: the event recorded after the last copy from it, and whether that copy may still be reading it
        self._events = [torch.cuda.Event() if self.on_cuda else None for _ in range(num_slots)]
        self._pending = [False] * num_slots
        self._slot = num_slots - 1  # the slot of the current stage (the first stage takes slot 0)
        self._device_buf: torch.Tensor | None = None  # uint8 [capacity] on the device (separate buffer only)
        self._device_typed: dict[np.dtype, torch.Tensor] = {}
        # The current stage: runs of consecutive same-dtype sections (packed, each run 8-byte aligned) as
        # (first element, dtype, section sizes), and the host views handed out.
        self._runs: list[tuple[int, np.dtype, list[int]]] = []
        self._host_views: list[np.ndarray] = []
        self._used = 0
        self._grow(initial_bytes)
        for slot in range(num_slots):  # allocated up front: no pinned allocation in the first forwards
            self._alloc_slot(slot)

    @property
    def slot(self) -> int:
        """The host slot of the current stage (``0 .. num_slots - 1``, in turn)."""
        return self._slot

    def stage(self, sections: Sequence[tuple[int, type | np.dtype]]) -> list[np.ndarray]:
        """Lay out ``sections`` (``(numel, dtype)`` each, dtype one of int64, int32, bool, uint8) in the next host
        slot and return writable host views, one per section, in order: fill them, then call :meth:`to_device`.

        Waits (CUDA) only if the copy made from that slot ``num_slots`` stages ago has not landed yet."""
        runs: list[tuple[int, np.dtype, list[int]]] = []
        offset = 0  # bytes
        for numel, dtype in sections:
            dtype = np.dtype(dtype)
            if dtype not in _TORCH_DTYPE:
                raise TypeError(f"a staged section must be int64, int32, bool or uint8, got {dtype}")
            if runs and runs[-1][1] == dtype:
                runs[-1][2].append(numel)
            else:
                offset = -(-offset // ALIGN) * ALIGN
                runs.append((offset // dtype.itemsize, dtype, [numel]))
            offset += numel * dtype.itemsize
        if offset > self.capacity:
            self._grow(max(2 * self.capacity, offset))
        slot = (self._slot + 1) % self.num_slots
        if self._hosts[slot].numel() < self.capacity:
            # smaller than the grown capacity: fresh memory (the old block stays alive until its copy has run)
            self._alloc_slot(slot)
        elif self._pending[slot]:
            event = self._events[slot]
            if event is not None and not event.query():
                self.num_waits += 1
                event.synchronize()  # that copy still reads this pinned memory until it lands
            self._pending[slot] = False
        self._slot, self._runs, self._used = slot, runs, offset
        typed_views = self._host_typed[slot]
        views = []
        for first, dtype, sizes in runs:
            typed = typed_views[dtype]
            for numel in sizes:
                views.append(typed[first : first + numel])
                first += numel
        self._host_views = views
        return views

    def to_device(self) -> list[torch.Tensor]:
        """The staged sections as 1-D tensors on the device, one per section. With a separate device buffer
        (CUDA) this is the forward's one host-to-device copy (non-blocking, from pinned memory, on the current
        stream)."""
        if not self.separate:
            return [torch.from_numpy(v) for v in self._host_views]  # the host memory itself
        slot = self._slot
        self._device_buf[: self._used].copy_(self._hosts[slot][: self._used], non_blocking=True)
        self.num_copies += 1
        if self._events[slot] is not None:
            self._events[slot].record()
            self._pending[slot] = True
        out: list[torch.Tensor] = []
        for first, dtype, sizes in self._runs:  # one slice and one split per run of same-dtype sections
            run = self._device_typed[dtype][first : first + sum(sizes)]
            out += run.split(sizes) if len(sizes) > 1 else [run]
        return out

    def _grow(self, nbytes: int) -> None:
        """Raise the capacity to ``nbytes`` (rounded up to ``ALIGN``): a new device buffer now, each host slot when
        it is next used."""
        nbytes = -(-nbytes // ALIGN) * ALIGN
        if self.separate:
            self._device_buf = torch.zeros(nbytes, dtype=torch.uint8, device=self.device)
            # the whole buffer viewed as each dtype once, so a section is one slice (runs start 8-byte aligned)
            self._device_typed = {d: self._device_buf.view(t) for d, t in _TORCH_DTYPE.items()}
        self.capacity = nbytes
        self.num_grows += 1

    def _alloc_slot(self, slot: int) -> None:
        host = torch.zeros(self.capacity, dtype=torch.uint8, pin_memory=self.on_cuda)
        host_np = host.numpy()
        self._hosts[slot] = host
        self._host_typed[slot] = {d: host_np.view(d) for d in _TORCH_DTYPE}
        self._pending[slot] = False  # nothing has been copied from the new memory
