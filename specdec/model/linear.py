"""``Linear``: ``nn.Linear`` with an optional oneDNN-prepacked copy of its weight for CPU float32 windows.

Why: speculative decoding pays off only if the target's forward over a k+1-token window costs about what a
one-token decode costs (the layer is weight-bandwidth bound either way). On CPU, MKL's float32 GEMM
(``F.linear``) keeps that promise for up to 3 rows, then switches to a path that repacks the whole weight
on every call: measured on SmolLM2-135M (1 thread), the LM head costs 13 ms for 1-3 rows and 26-45 ms for
4-8, and a whole forward over 5 tokens 1.6x a decode step. oneDNN's prepacked weights (the format
``torch.compile``'s CPU freezing uses) cost the same for 1 to 16 rows but carry ~0.06 ms of fixed overhead
per call, which loses for one row. So ``Linear`` keeps both: ``F.linear`` below ``PREPACK_MIN_ROWS`` rows
(decode), the packed copy from there up (verification windows, batched decode, prefill).

The packed copy doubles the memory of the linear weights; ``prepack_linears`` is therefore opt-out
(``LLM(prepack_weights=False)``) and skipped when free memory is short. It is a plain attribute, not a
parameter or buffer: it is not in ``state_dict`` and is never moved between devices (CPU only).
"""

from __future__ import annotations

import logging
import os

import torch
from torch import nn

logger = logging.getLogger(__name__)

PREPACK_MIN_ROWS = 4  # F.linear below this many rows, the prepacked weight from here up
_PACK_BATCH_HINT = 8  # the row count oneDNN tunes the packed layout for (measured: good for 4..16 rows)


class Linear(nn.Linear):
    """``nn.Linear`` for 2-D inputs ``x: [M, in_features]`` that uses ``packed_weight`` when it is set and
    ``M >= PREPACK_MIN_ROWS``. Output ``[M, out_features]`` in ``x``'s dtype either way."""

    packed_weight: torch.Tensor | None = None  # oneDNN-layout copy of ``weight``, set by ``prepack()``

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed_weight is not None and x.dim() == 2 and x.shape[0] >= PREPACK_MIN_ROWS:
            return torch.ops.mkldnn._linear_pointwise(x.contiguous(), self.packed_weight, self.bias, "none", [], "")
        return nn.functional.linear(x, self.weight, self.bias)

    def prepack(self) -> None:
        """Build the packed copy from the current ``weight`` (call again after changing the weight)."""
        self.packed_weight = torch.ops.mkldnn._reorder_linear_weight(self.weight.detach(), _PACK_BATCH_HINT)

    def unpack(self) -> None:
        self.packed_weight = None


def prepack_supported(dtype: torch.dtype, device: torch.device) -> bool:
    """True where the packed path exists and measured faster: CPU, float32, a torch built with oneDNN."""
    return (device.type == "cpu" and dtype == torch.float32 and torch.backends.mkldnn.is_available()
            and hasattr(torch.ops.mkldnn, "_reorder_linear_weight"))


def check_prepack_option(prepack_weights: object, dtype: torch.dtype, device: torch.device) -> None:
    """``ValueError`` unless ``prepack_weights`` is None / False, or True where ``prepack_supported``."""
    if prepack_weights not in (None, True, False):
        raise ValueError(f"prepack_weights must be None (where supported), True or False, got {prepack_weights!r}")
    if prepack_weights and not prepack_supported(dtype, device):
        raise ValueError(f"prepack_weights=True needs a CPU float32 model and a torch with oneDNN; got {dtype} on "
                         f"{device} (use None for 'where supported', or False)")


def _available_memory_bytes() -> int | None:
    """MemAvailable (free + reclaimable page cache, e.g. the safetensors just read), else free pages."""
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


def prepack_linears(model: nn.Module, required: bool = False) -> int:
    """Prepack every ``Linear`` of ``model``; returns the bytes added (0 when skipped).

    ``required=False`` (the "auto" setting) skips, with a warning, when the copies would take more than half of
    the available memory (``MemAvailable``); ``required=True`` packs regardless.
    """
    linears = [m for m in model.modules() if isinstance(m, Linear)]
    nbytes = sum(m.weight.numel() * m.weight.element_size() for m in linears)
    available = _available_memory_bytes()
    if not required and available is not None and 2 * nbytes > available:
        logger.warning("not prepacking linear weights (LLM(prepack_weights=None)): the copies would take %.1f GB "
                       "of %.1f GB available; verification windows will be slower on this CPU",
                       nbytes / 1e9, available / 1e9)
        return 0
    for m in linears:
        m.prepack()
    return nbytes
