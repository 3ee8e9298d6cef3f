"""Host-to-device transfers that do not stall the host.

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
