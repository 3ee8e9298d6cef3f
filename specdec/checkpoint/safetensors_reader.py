"""Read safetensors tensors straight into the tensors that will hold them: no mmap, no whole-file copy.

Why not ``safetensors.safe_open``: it maps the file, and every page a tensor is read from stays in the process's
resident set until the file is closed - loading the converted fp32 Qwen2.5-1.5B (one 6.2 GB file) into bf16 held
the whole fp32 file plus the bf16 model at once (issue 19). Here each tensor is read with ``readinto`` (the page
cache holds the file, not the process): straight into its destination when the dtypes match, else through a
bounded scratch buffer of ``chunk_bytes``, converted chunk by chunk. Peak memory while loading is then the
model in its running dtype plus one chunk.

The format (https://github.com/huggingface/safetensors): 8 bytes little-endian header length N, N bytes of JSON
``{name: {"dtype", "shape", "data_offsets": [begin, end]}, "__metadata__": {...}}``, then the data; offsets are
relative to the end of the header, data is little-endian and C-contiguous.
"""

from __future__ import annotations

import json
import math
import struct
from dataclasses import dataclass

import torch

SAFETENSORS_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool,
}  # fmt: skip
CHUNK_BYTES = 64 * 2**20  # the scratch buffer of a converting read (a dtype change or a non-CPU destination)
_MAX_HEADER_BYTES = 100 * 2**20


@dataclass(frozen=True)
class TensorEntry:
    """One tensor of a safetensors file: where its bytes are, and how to read them into a destination."""

    name: str
    file: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    offset: int  # absolute byte offset of the data in ``file``
    nbytes: int

    def read(self) -> torch.Tensor:
        """The tensor, freshly allocated on CPU in its stored dtype."""
        out = torch.empty(self.shape, dtype=self.dtype)
        self.read_into(out)
        return out

    def read_into(self, dest: torch.Tensor, chunk_bytes: int = CHUNK_BYTES) -> None:
        """Fill ``dest`` (same shape; any dtype and device; contiguous) with this tensor's values, converted to
        ``dest.dtype`` as ``Tensor.copy_`` converts. A CPU destination of the stored dtype is read into directly;
        otherwise through a scratch buffer of at most ``chunk_bytes`` (whole rows of the first dimension)."""
        TensorSlice(self, 0, 0, self.shape[0] if self.shape else 1).read_into(dest, chunk_bytes)

    def narrow(self, dim: int, start: int, length: int) -> TensorSlice:
        """Rows (``dim`` 0) or columns (``dim`` 1, a 2-D tensor) ``[start, start + length)`` of this tensor, read
        on demand like the tensor itself (a tensor-parallel rank's share: specdec/distributed/sharding.py)."""
        return TensorSlice(self, dim, start, length)


@dataclass(frozen=True)
class TensorSlice:
    """Rows or columns ``[start, start + length)`` of a ``TensorEntry``, read straight from the file.

    Rows are one contiguous byte range: only they are read. Columns (dim 1 of a 2-D tensor: a row-parallel
    linear's input features) are strided: whole rows pass through a scratch buffer of at most ``chunk_bytes``
    and only the wanted columns are kept, so the file's bytes are read but the process never holds more than the
    slice plus one chunk."""

    entry: TensorEntry
    dim: int
    start: int
    length: int

    def __post_init__(self) -> None:
        full = self.entry.shape or (1,)  # a scalar reads as one row
        if self.dim not in (0, 1) or (self.dim == 1 and len(full) != 2):
            raise ValueError(f"cannot slice tensor {self.entry.name!r} of shape {full} along dim {self.dim}")
        if not (0 <= self.start and self.length >= 0 and self.start + self.length <= full[self.dim]):
            raise ValueError(f"slice [{self.start}, {self.start + self.length}) of dim {self.dim} is outside tensor "
                             f"{self.entry.name!r} of shape {full}")

    @property
    def name(self) -> str:
        return self.entry.name

    @property
    def shape(self) -> tuple[int, ...]:
        shape = list(self.entry.shape) or [1]
        shape[self.dim] = self.length
        return tuple(shape) if self.entry.shape else ()

    def read(self) -> torch.Tensor:
        """The slice, freshly allocated on CPU in the stored dtype."""
        out = torch.empty(self.shape, dtype=self.entry.dtype)
        self.read_into(out)
        return out

    def read_into(self, dest: torch.Tensor, chunk_bytes: int = CHUNK_BYTES) -> None:
        """Fill ``dest`` (this slice's shape; any dtype and device; contiguous), converted to ``dest.dtype``."""
        e = self.entry
        if tuple(dest.shape) != self.shape:
            raise ValueError(f"tensor {e.name!r} in {e.file} (slice) has shape {self.shape}, the destination "
                             f"{tuple(dest.shape)}")
        if not dest.is_contiguous():
            raise ValueError(f"read_into needs a contiguous destination for {e.name!r}")
        full_row = math.prod(e.shape[1:]) if e.shape else 1  # elements of one stored row
        item = _itemsize(e.dtype)
        rows = self.length if self.dim == 0 else (e.shape[0] if e.shape else 1)
        first_row = self.start if self.dim == 0 else 0
        cols = (self.start, self.length) if self.dim == 1 else (0, full_row)
        with open(e.file, "rb", buffering=0) as f:
            f.seek(e.offset + first_row * full_row * item)
            if self.dim == 0 and dest.device.type == "cpu" and dest.dtype == e.dtype:
                _read_exact(f, dest, e.name, e.file)
                return
            step = max(1, chunk_bytes // max(1, full_row * item))
            flat = dest.reshape(rows, cols[1])  # (rows, kept elements per row): chunks are whole rows
            scratch = torch.empty(min(step, rows) * full_row, dtype=e.dtype)
            for start in range(0, rows, step):
                n = min(step, rows - start)
                part = scratch[: n * full_row]
                _read_exact(f, part, e.name, e.file)
                flat[start : start + n].copy_(part.view(n, full_row)[:, cols[0] : cols[0] + cols[1]])


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def _read_exact(f, tensor: torch.Tensor, name: str, file: str) -> None:
    """``readinto`` the bytes of the contiguous CPU ``tensor``; ``ValueError`` if the file ends first."""
    view = memoryview(tensor.view(-1).view(torch.uint8).numpy()) if tensor.numel() else memoryview(b"")
    done = 0
    while done < len(view):
        got = f.readinto(view[done:])
        if not got:
            raise ValueError(f"weight file {file} ends inside tensor {name!r} (truncated or corrupt)")
        done += got


def read_header(file: str) -> list[TensorEntry]:
    """The tensors of one safetensors file, in file order; ``ValueError`` for a file that is not one."""
    try:
        with open(file, "rb") as f:
            raw = f.read(8)
            if len(raw) != 8:
                raise ValueError(f"weight file {file} is too short to be safetensors")
            (header_len,) = struct.unpack("<Q", raw)
            if header_len > _MAX_HEADER_BYTES:
                raise ValueError(f"weight file {file} has a {header_len}-byte header: not safetensors, or corrupt")
            header = json.loads(f.read(header_len))
            f.seek(0, 2)
            file_size = f.tell()
    except (OSError, json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"weight file {file} is corrupt or unreadable: {e}") from e
    base = 8 + header_len
    entries = []
    for name, info in header.items():
        if name == "__metadata__":
            continue
        dtype = SAFETENSORS_DTYPES.get(info.get("dtype"))
        if dtype is None:
            raise ValueError(f"tensor {name!r} in {file} has dtype {info.get('dtype')!r}; supported: "
                             f"{sorted(SAFETENSORS_DTYPES)}")
        shape = tuple(int(d) for d in info["shape"])
        begin, end = (int(x) for x in info["data_offsets"])
        if end - begin != math.prod(shape) * _itemsize(dtype) or base + end > file_size:
            raise ValueError(f"tensor {name!r} in {file}: data offsets [{begin}, {end}) do not match its shape "
                             f"{shape} / {info['dtype']} or run past the end of the file (corrupt or truncated)")
        entries.append(TensorEntry(name, file, dtype, shape, base + begin, end - begin))
    return sorted(entries, key=lambda e: e.offset)
