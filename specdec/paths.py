"""Where specdec keeps files on disk: one cache root for converted checkpoints, downloads and built libraries."""

from __future__ import annotations

import os
from pathlib import Path


def cache_root() -> Path:
    """``$SPECDEC_CACHE``, or ``~/.cache/specdec``: holds ``models/`` (the default model, converted),
    ``converted/`` (other GGUF files, converted), ``downloads/`` (sources), ``native/`` (built CPU kernels) and
    ``verified/`` (checked hashes)."""
    return Path(os.environ.get("SPECDEC_CACHE") or Path.home() / ".cache" / "specdec").expanduser()
