"""Step env: the machine and software a run measured (env.json). The orchestrator reads ``cuda`` from it."""

from __future__ import annotations

import os
import platform
import shutil
import subprocess
import sys

from bench.gpu_steps.common import REPO, parse_args, write_json


def run(cmd: list[str]) -> str | None:
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout.strip() if out.returncode == 0 else None


def find_sanitizer() -> str | None:
    found = shutil.which("compute-sanitizer")
    if found:
        return found
    for candidate in ("/usr/local/cuda/bin/compute-sanitizer", "/usr/local/cuda/compute-sanitizer/compute-sanitizer"):
        if os.path.isfile(candidate) and os.access(candidate, os.X_OK):
            return candidate
    return None


def source_digest() -> str:
    """sha256 (first 12 hex digits) of every .py file under specdec/ and kernels/, by relative path: identifies the
    code that ran even where the checkout's git metadata is stale (a copied working tree: the device tool's
    reports a commit that is not the one it carries). Here: ``python -c "from bench.gpu_steps.env import
    source_digest; print(source_digest())"``."""
    import hashlib

    h = hashlib.sha256()
    for base in ("specdec", "kernels"):
        for path in sorted((REPO / base).rglob("*.py")):
            h.update(str(path.relative_to(REPO)).encode() + b"\0" + path.read_bytes() + b"\0")
    return h.hexdigest()[:12]


def git_commit() -> str:
    commit = run(["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"])
    if commit is None:
        return "unknown (no git checkout)"
    dirty = run(["git", "-C", str(REPO), "status", "--porcelain", "--untracked-files=no"])
    return commit + ("+dirty" if dirty else "")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(__doc__.splitlines()[0], argv)
    import torch

    info: dict = {
        "python": platform.python_version(),
        "executable": sys.executable,
        "torch": torch.__version__,
        "cuda_runtime": torch.version.cuda,
        "cuda": torch.cuda.is_available(),
        "git_commit": git_commit(),
        "source_digest": source_digest(),
        "machine": platform.machine(),
        "cpu_count": os.cpu_count(),
        "TRITON_INTERPRET": os.environ.get("TRITON_INTERPRET"),
        "nvidia_smi": run(["nvidia-smi", "--query-gpu=name,memory.total,driver_version,clocks.max.sm",
                           "--format=csv,noheader"]),
        "compute_sanitizer": find_sanitizer(),
        "dry_run": args.dry_run,
    }
    try:
        import triton

        info["triton"] = triton.__version__
    except ImportError as err:
        info["triton"] = f"not importable: {err}"
    import specdec
    import specdec.kernels

    info["specdec_file"] = specdec.__file__
    info["specdec_kernels_file"] = specdec.kernels.__file__
    if info["cuda"]:
        props = torch.cuda.get_device_properties(0)
        info.update(device=props.name, sm_count=props.multi_processor_count,
                    capability=f"{props.major}.{props.minor}", memory_gib=round(props.total_memory / 2**30, 1),
                    l2_mb=round(getattr(props, "L2_cache_size", 0) / 2**20, 1))  # fmt: skip
    else:
        info.update(device=f"cpu ({platform.processor() or platform.machine()})", sm_count=None)
    write_json(args.out / "env.json", info)
    for key, value in info.items():
        print(f"{key}: {value}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
