"""The host's memory: how much is available now (sizes the CPU KV pool and decides whether to prepack weights)."""

from __future__ import annotations

import os


def available_memory_bytes() -> int | None:
    """MemAvailable (free + reclaimable page cache, e.g. the safetensors just read), else free pages; None where
    neither is known."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None
