"""Tensor-parallel options checked before a model is loaded: the target's size and timeout, and the draft's size."""

from __future__ import annotations

import torch

from specdec.config.speculative import SpeculativeConfig
from specdec.distributed.launch_env import LaunchEnv, check_launch


def check_tensor_parallel_options(size: object, timeout_s: object, device: torch.device) -> None:
    """``ValueError`` unless ``size`` ranks (one per CUDA device, or as torchrun launched) and ``timeout_s`` fit."""
    if not isinstance(size, int) or isinstance(size, bool) or size < 1:
        raise ValueError(f"tensor_parallel_size must be an integer >= 1, got {size!r}")
    if not isinstance(timeout_s, (int, float)) or isinstance(timeout_s, bool) or not timeout_s > 0:
        raise ValueError(f"distributed_timeout_s must be a number of seconds > 0, got {timeout_s!r}")
    check_launch(size, device)  # under torchrun: size == WORLD_SIZE, a CUDA device per local rank
    if size == 1:
        return
    if device.type == "cuda" and LaunchEnv.from_environ() is None and size > torch.cuda.device_count():
        raise ValueError(f"tensor_parallel_size={size} needs {size} CUDA devices (one per rank), but torch sees "
                         f"{torch.cuda.device_count()}; allowed: 1..{torch.cuda.device_count()}")


def check_draft_tensor_parallel(spec: SpeculativeConfig, size: int) -> int:
    """The draft's tensor-parallel size under a target sharded over ``size`` ranks (``spec``'s
    ``draft_tensor_parallel_size``; None: the target's, for a draft model), or ``ValueError`` saying what is
    allowed."""
    draft = spec.draft_tensor_parallel_size
    if draft is None:
        draft = size if spec.uses_draft_model else 1
    if draft not in (1, size):
        raise ValueError(f"draft_tensor_parallel_size must be 1 (the draft on rank 0 only) or the target's "
                         f"tensor_parallel_size ({size}), got {draft}")
    if draft > 1 and spec.draft_vocab is not None:
        raise ValueError(f"draft_vocab (a reduced draft LM head) needs the draft on rank 0 only: set "
                         f"draft_tensor_parallel_size=1 (got {draft}, the target's tensor_parallel_size by default)")
    if draft > 1 and spec.method == "eagle3":
        raise ValueError("an EAGLE-3 head (one decoder layer) runs on rank 0 only: draft_tensor_parallel_size must "
                         f"be None or 1 with method 'eagle3', got {draft}")
    return draft
