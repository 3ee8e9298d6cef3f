"""Step tests: ``pytest -m gpu tests/gpu`` and the kernel tests' CUDA parametrisations, compiled for real.

On CUDA: two pytest runs (output to tests.log; exit code the worse of the two). The NCCL tensor-parallel tests
(tests/gpu/test_tp_nccl.py) need 2 CUDA devices and fail by design on fewer; on a one-GPU machine they are left out
of the first run and a line says so ("== NCCL ...: not run: ..."), so that the step's status is the other tests'.
Dry run (no CUDA): the same selections are only collected, proving they import and select what they should;
"skipped: no CUDA".
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import time

from bench.gpu_steps.common import REPO, parse_args, seconds_left

SELECTIONS = [
    ("production shapes (tests/gpu, -m gpu)", ["tests/gpu", "-m", "gpu"]),
    ("kernel tests, CUDA parametrisations", ["tests/kernels", "-k", "cuda and not gpu_compile"]),
]
MULTI_GPU_TESTS = "tests/gpu/test_tp_nccl.py"  # NCCL tensor parallelism: 2 CUDA devices (rank r on cuda:r)


def left_out(selection: list[str], device_count: int) -> list[str]:
    """The test files of ``selection`` this machine cannot run: the NCCL tests below 2 CUDA devices."""
    return [MULTI_GPU_TESTS] if device_count < 2 and "tests/gpu" in selection else []


def pytest_cmd(selection: list[str], collect_only: bool, ignore: list[str] = ()) -> list[str]:
    paths = [str(REPO / s) if s.startswith("tests/") else s for s in selection]
    cmd = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "--rootdir", str(REPO), "-c",
           str(REPO / "pyproject.toml"), "-q", "-rfE", *paths]  # fmt: skip
    cmd += [f"--ignore={REPO / path}" for path in ignore]
    if collect_only:
        return [*cmd, "--collect-only"]
    if importlib.util.find_spec("xdist") is not None:  # Triton compiles are CPU-bound: use the host's cores
        cmd += ["-n", str(min(8, max(1, (os.cpu_count() or 2) // 2)))]
    return cmd


def main(argv: list[str] | None = None) -> int:
    args = parse_args(__doc__.splitlines()[0], argv)
    import torch

    cuda = torch.cuda.is_available() and not args.dry_run
    device_count = torch.cuda.device_count() if cuda else 0
    worst = 0
    for i, (name, selection) in enumerate(SELECTIONS):
        ignore = left_out(selection, device_count) if cuda else []
        for path in ignore:
            print(f"== NCCL tensor-parallel tests ({path}): not run: {device_count} CUDA device(s), they need 2",
                  flush=True)
        cmd = pytest_cmd(selection, collect_only=not cuda, ignore=ignore)
        budget = seconds_left(args) - 10
        if budget < 20:
            print(f"== {name}: not run, {budget + 10:.0f} s left", flush=True)
            worst = worst or 124
            continue
        # the first selection may use at most 60% of what is left: the second must get its turn
        limit = budget * 0.6 if i == 0 and len(SELECTIONS) > 1 else budget
        print(f"== {name}: {' '.join(cmd)} (limit {limit:.0f} s)", flush=True)
        start = time.time()
        try:
            rc = subprocess.run(cmd, timeout=None if limit == float("inf") else limit).returncode
        except subprocess.TimeoutExpired:
            rc = 124
            print(f"== {name}: TIMEOUT after {limit:.0f} s", flush=True)
        if not cuda and rc == 5:  # collection selected nothing (no CUDA parametrisation without CUDA)
            rc = 0
        print(f"== {name}: exit {rc} in {time.time() - start:.0f} s", flush=True)
        worst = worst or rc
    if not cuda:
        print("STATUS: skipped: no CUDA (collected only)")
    return worst


if __name__ == "__main__":
    sys.exit(main())
