"""Forward timings for adaptive k's cost model, taken without a host sync."""

from __future__ import annotations

import time
from collections.abc import Callable

import torch


class ForwardTimer:
    """Times forwards for the cost model without a host sync.

    ``stop(start(device), record)`` calls ``record(seconds)``: at once on CPU (perf counters: the forward has
    run by then); on CUDA at the first ``flush()`` after the forward's end event has completed, from the pair
    of CUDA events recorded around it (``Event.query`` does not wait; the engine flushes after its host read).
    """

    def __init__(self):
        self._pending: list[tuple[torch.cuda.Event, torch.cuda.Event, Callable[[float], None]]] = []

    def start(self, device: torch.device) -> torch.cuda.Event | float:
        if device.type == "cuda":
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return time.perf_counter()

    def stop(self, start: torch.cuda.Event | float, record: Callable[[float], None]) -> None:
        if isinstance(start, float):
            record(time.perf_counter() - start)
            return
        end = torch.cuda.Event(enable_timing=True)
        end.record()
        self._pending.append((start, end, record))

    def flush(self) -> None:
        """Record every timed forward whose end event has completed (none is waited for)."""
        waiting = []
        for start, end, record in self._pending:
            if end.query():
                record(start.elapsed_time(end) / 1000.0)
            else:
                waiting.append((start, end, record))
        self._pending = waiting
