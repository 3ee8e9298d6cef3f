"""Forward timings for adaptive k's cost model, taken without a host sync."""

from __future__ import annotations

import time
from collections.abc import Callable

import torch


class ForwardTimer:
    """Times forwards for the cost model without a host sync.

    ``stop(start(device), record)`` calls ``record(seconds)``: at once on CPU (the forward has run by then); on
    CUDA at the first ``flush()`` after the forward's end event has completed, from the pair of CUDA events
    recorded around it (``Event.query`` does not wait; the engine flushes after its host read).

    The CPU clock: with one intra-op thread (``torch.get_num_threads() == 1``) the calling thread's CPU time
    (``time.thread_time``), which a preemption by another process does not inflate - on a shared machine wall
    time added 2-3x spikes to single forwards and the cost model chased them; the forward runs on that thread
    alone, so its CPU time is its cost. With several threads, wall time (``perf_counter``: the pool's threads run
    on other clocks).
    """

    def __init__(self):
        self._pending: list[tuple[torch.cuda.Event, torch.cuda.Event, Callable[[float], None]]] = []
        self.paused = False  # while True, start() returns None and stop(None, ...) records nothing

    def start(self, device: torch.device) -> torch.cuda.Event | tuple[Callable[[], float], float] | None:
        if self.paused:
            return None
        if device.type == "cuda":
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        clock = _cpu_clock()
        return clock, clock()

    def stop(self, start: torch.cuda.Event | tuple[Callable[[], float], float] | None,
             record: Callable[[float], None]) -> None:
        if start is None:  # started while paused
            return
        if isinstance(start, tuple):
            clock, began = start
            record(clock() - began)
            return
        end = torch.cuda.Event(enable_timing=True)
        end.record()
        self._pending.append((start, end, record))

    def clear(self) -> None:
        """Drop the timings not yet recorded (a cost model reset: they belong to the forgotten one)."""
        self._pending = []

    def flush(self) -> None:
        """Record every timed forward whose end event has completed (none is waited for)."""
        waiting = []
        for start, end, record in self._pending:
            if end.query():
                record(start.elapsed_time(end) / 1000.0)
            else:
                waiting.append((start, end, record))
        self._pending = waiting


def _cpu_clock() -> Callable[[], float]:
    """The clock CPU forwards are timed by: the thread's CPU time with one intra-op thread, else wall time."""
    return time.thread_time if torch.get_num_threads() == 1 else time.perf_counter
