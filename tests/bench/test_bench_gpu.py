"""``python -m bench.gpu --dry-run``: the one GPU command, proven on CPU the way a GPU session will run it -
from the repository root with only ``PYTHONPATH=.`` - both with this checkout's install present and with it
hidden (the GPU host gets the repository copied, never pip-installed, so ``specdec.kernels`` does not import
there and the command must lay out its own site folder) - and what its steps promise that a CPU can check: the
step order, e2e's odd >= 3 timed runs and true medians, every request checked (a request that ends in error
fails the step), the static-forward counters of every runner, the profile's host waits counted by kind."""

from __future__ import annotations

import json
import os
import shutil
import statistics
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

REPO = Path(__file__).resolve().parents[2]
STEPS = ["env", "e2e", "tests", "sanitizer", "kernels", "quant", "breakdown"]  # the order they run in: e2e first
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
    assert "Real-weight acceptance measured on CPU" in summary  # bench.projection.speculative with the run's c, v(k)
    assert "CUDA graphs vs `enforce_eager=True`" in summary  # on CPU both eager: the code path, not a speedup
    assert "requests checked" in summary and "Static forwards during the timed runs" in summary
    info = json.loads((out / "env.json").read_text())
    run = info["run"]
    assert [s["name"] for s in run["steps"]] == [*STEPS, "summary"] and all(s["exit"] == 0 for s in run["steps"])
    assert info["TRITON_INTERPRET"] == "1" and info["cuda_probe"]["available"] is False
    e2e = json.loads((out / "e2e.json").read_text())
    assert list(e2e["pairs"]) == ["damped", "random"]  # the pair with real acceptance first
    assert e2e["prefix_caching"] is False and "failure" not in e2e
    for pair in e2e["pairs"].values():
        assert set(pair["batches"]) == {"1", "2"}
        for batch, row in pair["batches"].items():
            assert row["plain_tokens_per_s"] > 0 and row["spec_tokens_per_s"] > 0
            assert row["costs"]["c"] > 0 and row["costs"]["v_k"] > 0 and row["costs_eager"]["c"] > 0
            # c again with the draft's head cut to a reduced draft vocabulary (half the tiny 512 ids)
            assert row["costs_draft_vocab"]["c"] > 0 and row["costs_draft_vocab"]["draft_vocab_size"] == 256
            assert 0 < row["byte_share"]["draft_vocab"] < row["byte_share"]["full_vocab"]  # the cut head reads less
            # c and v(k) through the engine's runners, whose static forward served them (mode "eager" on CPU)
            assert row["costs"]["path"] == {"target": "static (eager)", "draft": "static (eager)"}
            # an odd number >= 3 of timed runs, and tok/s from the median run's own time
            reps = row["reps"]
            assert reps >= 3 and reps % 2 == 1
            (group,) = row["runs"]
            for name in ("plain", "spec"):
                seconds = group[name]["seconds"]
                assert len(seconds) == reps and statistics.median(seconds) in seconds
                assert row[f"{name}_tokens_per_s"] == pytest.approx(group[name]["tokens"] / statistics.median(seconds))
            assert row["requests_checked"] == 2 * reps * int(batch)
            # every runner counted (the draft's too), and the warm-up captured every bucket the timed runs used
            timed = row["static"]["timed"]
            assert set(timed) == {"plain", "spec"} and set(timed["spec"]) == {"target", "draft"}
            for by_runner in timed.values():
                for counts in by_runner.values():
                    assert counts["mode"] == "eager" and counts["buckets"] == 0
            assert timed["plain"]["target"]["replays"] > 0 and timed["spec"]["target"]["replays"] > 0
            # the draft's pure steps: through its draft loop (one program per round), not step by step
            assert timed["spec"]["draft"]["loop_steps"] > 0
    graphs = e2e["pairs"]["random"]["graphs_vs_eager"]
    assert graphs["1"]["static_timed"]["graphs"]["target"]["replays"] > 0
    assert graphs["1"]["static_timed"]["eager"]["target"]["mode"] is None
    assert e2e["fp32_greedy_identity"]["identical"] == e2e["fp32_greedy_identity"]["requests"]
    profile = e2e["profile"]
    assert profile["window"] == "bench.gpu: engine.step"
    assert {"cudaMemcpy", "cudaMemcpyAsync", "cudaStreamSynchronize", "cudaEventSynchronize",
            "cudaStreamWaitEvent"} <= set(profile["counts"])  # fmt: skip
    assert "aten::_local_scalar_dense" in (out / "profile.txt").read_text()
    kernels = json.loads((out / "kernels.json").read_text())
    assert kernels["attention"] and kernels["sampling"] and kernels["spec_sample"]
    for row in kernels["attention"]:
        assert row["sdpa_backend"] in row["sdpa_supported"] or row["sdpa_backend"] == "flash (cpu)", row
    quant = json.loads((out / "quant.json").read_text())
    assert quant["kernel"] and quant["plain"] and quant["self_draft"]
    for row in quant["kernel"]:  # the module's path against its own reference: only the bf16 output's rounding
        assert row["int8_rel_err"] < 1e-2 and row["int4_rel_err"] < 1e-2, row
    assert "### Quantized linears" in summary and "compute-sanitizer memcheck" in summary
    # the breakdown step (into kernels.json: 8 files): every case profiled through the runners' static forward
    breakdown = kernels["breakdown"]
    cases = [(c["step"], c["batch"], c["forward"]) for c in breakdown["cases"]]
    expected = [(step, b, forward) for forward in ("fused", "unfused")
                for step, b in [("decode", 1), ("decode", 2)] * 2 + [("spec round", 1), ("spec round", 2)]]
    expected[6:6] = [("spec round", 1, "fused, no draft loop"), ("spec round", 2, "fused, no draft loop")]
    # the fused forward's cases (the spec round also without the draft loop), then the unfused forward's (the before)
    assert cases == expected
    for case in breakdown["cases"]:
        assert case["kernels"] > 0 and case["bound_us"] > 0 and case["steady"]["tok_s"] > 0, case
        assert sum(g["share"] for g in case["groups"].values()) == pytest.approx(1.0)
        assert case["static"]["target"]["replays"] == 1 and case["groups"]["GEMM"]["kernels"] > 0
    for case in breakdown["cases"][5], breakdown["cases"][7]:  # k draft forwards (looped or not) in the bound
        assert case["static"]["draft"]["forwards"] >= 4
    assert "### Per-kernel breakdown of a decode step" in summary and "sampling+verification" in summary


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
    proc = run_bench_gpu(copy, env, out, "--only", "tests", "sanitizer", "real")  # real: opt-in, tiny model here
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
    assert statuses["real"].startswith("ok (CPU, tiny random model")
    real = json.loads((out / "real.json").read_text())
    assert [(g["batch"], g["temperature"], g["class"]) for g in real["groups"]] == [
        (b, t, c) for b in (1, 2) for t in (0.0, 0.8) for c in ("copy", "long")]  # fmt: skip
    for group in real["groups"]:  # plain + 2 drafters, 3 timed runs each, every request checked
        assert group["plain"]["tokens_per_s"] > 0 and group["costs"]["v_k"] > 0
        assert group["requests_checked"] == 3 * 3 * group["batch"]
        for row in group["methods"].values():  # c from the drafters' timed propose calls, both predictions made
            assert row["tokens_per_s"] > 0 and row["propose_calls"] > 0 and row["c"] > 0
            assert row["predicted_mix"] is not None
    assert "### Real weights: SmolLM2-135M-Instruct" in (out / "summary.md").read_text()


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


def fake_output(tokens: int, finish_reason: str = "length", error: str | None = None):
    return SimpleNamespace(request_id="0", error=error,
                           outputs=[SimpleNamespace(finish_reason=finish_reason, token_ids=[1] * tokens)])


def test_check_outputs_rejects_errors_and_short_requests():
    from bench.gpu_steps.e2e import RequestCheckError, check_outputs

    check_outputs([fake_output(8), fake_output(8)], 8, "ok")
    for bad in (fake_output(3, "error", "RuntimeError: CUDA error: an illegal memory access"), fake_output(5, "stop"),
                fake_output(7)):
        with pytest.raises(RequestCheckError, match="1 of 2 requests"):
            check_outputs([fake_output(8), bad], 8, "run")


def test_e2e_step_fails_when_a_request_ends_in_error(tmp_path, monkeypatch):
    """A fault in the speculative path ends its requests with finish_reason "error" (the engine isolates it); the
    e2e step must fail on it, not report the short outputs' tok/s."""
    import specdec.engine.engine as engine_module
    from bench.gpu_steps import e2e

    compute_step = engine_module.compute_step

    def faulty(batch, runner, speculative, **kwargs):
        if speculative is not None:
            raise RuntimeError("injected kernel fault")
        return compute_step(batch, runner, speculative, **kwargs)

    monkeypatch.setattr(engine_module, "compute_step", faulty)
    threads = torch.get_num_threads()
    try:
        assert e2e.main(["--dry-run", "--out", str(tmp_path / "out"), "--workdir", str(tmp_path)]) == 1
    finally:
        torch.set_num_threads(threads)
    result = json.loads((tmp_path / "out" / "e2e.json").read_text())
    assert "damped speculative batch 1" in result["failure"] and "injected kernel fault" in result["failure"]
    assert result["pairs"]["damped"]["batches"] == {}  # nothing measured after the failure


def test_profile_counts_host_waits_by_kind_inside_the_step_only():
    from bench.gpu_steps.e2e import STEP_LABEL, count_events

    def event(name, start, end, device="DeviceType.CPU"):
        return SimpleNamespace(name=name, time_range=SimpleNamespace(start=start, end=end), device_type=device)

    # on CUDA the range comes twice: its GPU-side annotation (the kernels' span, later) must not be the window
    events = [event(STEP_LABEL, 50, 120, "DeviceType.CUDA"), event(STEP_LABEL, 10, 100),
              event("cudaMemcpyAsync", 11, 12), event("cudaMemcpyAsync", 13, 14), event("cudaMemcpy", 15, 16),
              event("cudaStreamSynchronize", 17, 18), event("cudaStreamWaitEvent", 19, 20),
              event("cudaEventSynchronize", 21, 22), event("cudaDeviceSynchronize", 101, 102)]  # the bench's own
    result = count_events(events)
    counts = result["counts"]
    assert counts["cudaMemcpyAsync"] == 2 and counts["cudaMemcpy"] == 1 and counts["cudaStreamWaitEvent"] == 1
    assert counts["cudaDeviceSynchronize"] == 0 and counts["cudaEventSynchronize"] == 1
    assert result["host_waits"] == 3  # blocking memcpy, stream sync, event sync; not the async copies or the wait
    assert result["counts_whole_profile"]["cudaDeviceSynchronize"] == 1


def test_tests_step_leaves_the_nccl_tests_out_below_two_gpus():
    """On a one-GPU machine the NCCL tests (which fail by design there) are left out of the collection, and said."""
    from bench.gpu_steps import tests as step

    production = dict(step.SELECTIONS)["production shapes (tests/gpu, -m gpu)"]
    kernels = dict(step.SELECTIONS)["kernel tests, CUDA parametrisations"]
    assert step.left_out(production, 1) == [step.MULTI_GPU_TESTS]
    assert step.left_out(production, 2) == []
    assert step.left_out(kernels, 1) == []
    cmd = step.pytest_cmd(production, collect_only=True, ignore=step.left_out(production, 1))
    listed = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO).stdout
    full = subprocess.run(step.pytest_cmd(production, collect_only=True), capture_output=True, text=True,
                          cwd=REPO).stdout
    assert "test_tp_nccl.py" in full and "test_tp_nccl.py" not in listed
    assert "test_production_shapes.py" in listed  # the rest of tests/gpu is still collected
