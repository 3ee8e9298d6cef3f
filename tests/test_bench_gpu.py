"""``python -m bench.gpu --dry-run``: the one GPU command, proven on CPU the way a GPU session will run it -
from the repository root with only ``PYTHONPATH=.`` - both with this checkout's install present and with it
hidden (the GPU host gets the repository copied, never pip-installed, so ``specdec.kernels`` does not import
there and the command must lay out its own site folder)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
STEPS = ["env", "e2e", "tests", "sanitizer", "kernels"]  # the order they run in: e2e, the headline, first
# Removes setuptools' editable-install finder (what `pip install -e .` adds), as if specdec were not installed.
HIDE_INSTALL = """import sys
sys.meta_path[:] = [f for f in sys.meta_path if "__editable__" not in getattr(f, "__module__", "")]
sys.path_hooks[:] = [h for h in sys.path_hooks if "__editable__" not in getattr(h, "__module__", "")]
"""


def clean_env(pythonpath: str) -> dict:
    """This process's environment without what the test session set (PYTHONPATH, TRITON_*, CUDA_*)."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("PYTHON", "TRITON_", "CUDA_", "PYTEST_")) and k != "OMP_NUM_THREADS"}  # fmt: skip
    return {**env, "PYTHONPATH": pythonpath}


def run_bench_gpu(cwd: Path, env: dict, out: Path, *extra: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "bench.gpu", "--dry-run", "--out", str(out), *extra]
    return subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=400)


def test_dry_run_from_the_repository(tmp_path):
    out = tmp_path / "out"
    proc = run_bench_gpu(REPO, clean_env("."), out)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    files = sorted(p.name for p in out.iterdir())
    assert len(files) <= 8, files
    assert {"summary.md", "env.json", "kernels.json", "e2e.json", "profile.txt"} <= set(files)
    summary = (out / "summary.md").read_text()
    for step in STEPS:
        assert f"| {step} |" in summary, f"no line for step {step} in summary.md"
    assert "**Dry run**" in summary and "### Projection" in summary and "skipped: no CUDA" in summary
    assert "Real-weight acceptance measured on CPU" in summary  # bench.projection with the run's c, v(k)
    assert "CUDA graphs vs `enforce_eager=True`" in summary  # on CPU both eager: the code path, not a speedup
    info = json.loads((out / "env.json").read_text())
    run = info["run"]
    assert [s["name"] for s in run["steps"]] == [*STEPS, "summary"] and all(s["exit"] == 0 for s in run["steps"])
    assert info["TRITON_INTERPRET"] == "1" and info["cuda_probe"]["available"] is False
    e2e = json.loads((out / "e2e.json").read_text())
    assert set(e2e["pairs"]) == {"random", "damped"}
    for pair in e2e["pairs"].values():
        assert set(pair["batches"]) == {"1", "2"}
        for row in pair["batches"].values():
            assert row["plain_tokens_per_s"] > 0 and row["spec_tokens_per_s"] > 0
            assert row["costs"]["c"] > 0 and row["costs"]["v_k"] > 0
    assert e2e["fp32_greedy_identity"]["identical"] == e2e["fp32_greedy_identity"]["requests"]
    assert "aten::_local_scalar_dense" in (out / "profile.txt").read_text()
    kernels = json.loads((out / "kernels.json").read_text())
    assert kernels["attention"] and kernels["sampling"] and kernels["spec_sample"]
    for row in kernels["attention"]:
        assert row["sdpa_backend"] in row["sdpa_supported"] or row["sdpa_backend"] == "flash (cpu)", row


def test_dry_run_without_the_install_lays_out_a_site_folder(tmp_path):
    copy = tmp_path / "repo"
    copy.mkdir()
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc")
    for name in ("specdec", "kernels", "bench", "tests"):
        shutil.copytree(REPO / name, copy / name, ignore=ignore)
    shutil.copy(REPO / "pyproject.toml", copy)
    hide = tmp_path / "hide"
    hide.mkdir()
    (hide / "sitecustomize.py").write_text(HIDE_INSTALL)
    env = clean_env(f"{hide}{os.pathsep}.")
    probe = subprocess.run([sys.executable, "-c", "import specdec.kernels"], cwd=copy, env=env, capture_output=True)
    assert probe.returncode != 0, "the install is not hidden: this test would prove nothing"

    out = tmp_path / "out"
    proc = run_bench_gpu(copy, env, out, "--only", "tests", "sanitizer")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    info = json.loads((out / "env.json").read_text())
    assert info["run"]["layout"].startswith("a site folder")
    kernels_file = Path(info["specdec_kernels_file"]).resolve()
    assert kernels_file.parent.name == "kernels" and kernels_file.parent.parent.name == "specdec"
    assert copy not in kernels_file.parents and REPO not in kernels_file.parents
    statuses = {s["name"]: s["status"] for s in info["run"]["steps"]}
    assert statuses["kernels"] == statuses["e2e"] == "skipped: not selected"
    assert statuses["tests"].startswith("skipped: no CUDA") and statuses["sanitizer"].startswith("skipped: no CUDA")
    assert "tests collected" in (out / "tests.log").read_text()


def test_a_run_without_dry_run_and_without_cuda_measures_nothing(tmp_path):
    """No CUDA found by the orchestrator's probe: no measurement step runs (never the interpreter or the CPU under a
    GPU run's name), the run says why and exits 1; the env step ran with TRITON_INTERPRET=0."""
    out = tmp_path / "out"
    env = {**clean_env("."), "CUDA_VISIBLE_DEVICES": "", "TRITON_INTERPRET": "1"}
    cmd = [sys.executable, "-m", "bench.gpu", "--out", str(out), "--only", "kernels", "--budget-s", "300"]
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=400)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    info = json.loads((out / "env.json").read_text())
    assert info["TRITON_INTERPRET"] == "0" and info["cuda_probe"]["available"] is False
    statuses = {s["name"]: s["status"] for s in info["run"]["steps"]}
    assert statuses["kernels"].startswith("not run: no CUDA") and statuses["e2e"] == "skipped: not selected"
    assert statuses["env"] == statuses["summary"] == "ok"
    assert not (out / "kernels.json").exists()
