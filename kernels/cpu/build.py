"""Build a native CPU library from C sources with the system's compiler, once per source version, and load it.

The library lives in ``$SPECDEC_CACHE/native/<hash of sources, headers and flags>/lib<name>.so``: a changed source
builds anew, and parallel builders (pytest-xdist workers) each build aside and rename into place.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

from specdec.paths import cache_root

logger = logging.getLogger(__name__)


def cpu_flags() -> set[str]:
    """The CPU's feature flags from ``/proc/cpuinfo`` (empty where it cannot be read)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return set()
    for line in text.splitlines():
        if line.startswith("flags"):
            return set(line.split(":", 1)[1].split())
    return set()


def build_library(name: str, sources: list[Path], headers: list[Path], cflags: list[str],
                  what_is_lost: str) -> ctypes.CDLL | None:
    """Compile ``sources`` into ``lib<name>.so`` (cached) and load it; None (with a warning naming
    ``what_is_lost``) where there is no C compiler or the build fails, or where ``SPECDEC_NATIVE=0``."""
    if os.environ.get("SPECDEC_NATIVE", "1") == "0":
        return None
    compiler = shutil.which(os.environ.get("CC", "gcc")) or shutil.which("cc")
    if compiler is None:
        logger.warning("no C compiler (gcc / cc / $CC) found: %s", what_is_lost)
        return None
    source = b"".join(path.read_bytes() for path in sources + headers)
    tag = hashlib.sha256(source + " ".join(cflags).encode()).hexdigest()[:16]
    out_dir = cache_root() / "native" / tag
    lib_path = out_dir / f"lib{name}.so"
    if not lib_path.exists():
        out_dir.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=out_dir) as tmp:  # build aside, then rename: parallel builders agree
            tmp_lib = Path(tmp) / lib_path.name
            done = subprocess.run([compiler, *cflags, *map(str, sources), "-o", str(tmp_lib), "-lm"],
                                  capture_output=True, text=True)
            if done.returncode != 0:
                logger.warning("building %s failed (%s): %s", name, what_is_lost, done.stderr.strip()[-2000:])
                return None
            os.replace(tmp_lib, lib_path)
    return ctypes.CDLL(str(lib_path))
