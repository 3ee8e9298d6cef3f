"""The project's one command for a GPU: every GPU measurement in one call, results ready for docs/results.md.

    PYTHONPATH=. python3 -m bench.gpu --out DIR [--dry-run] [--only STEP ...] [--budget-s N] [--alpha A ...]

Runs from the repository alone (no pip install): if ``specdec.kernels`` cannot be imported (``kernels/`` is only
mapped to ``specdec.kernels`` by an install), it lays out a temporary site folder - a copy of ``specdec/`` with
``kernels/`` as ``specdec/kernels/`` - and runs every step with ``PYTHONPATH=<site>:<repo>/tests:<repo>``, from
a scratch working directory (so the repository's own ``specdec/`` never shadows the site's). Whether there is a GPU
is asked by this process itself (``torch.cuda.is_available()`` in a subprocess, up to 240 s: a cold VM can take a
minute), never by a step. Without ``--dry-run`` every step runs with ``TRITON_INTERPRET=0``, and if the probe
finds no CUDA the measurement steps are not run at all (recorded as such, exit 1): a run without ``--dry-run``
never measures the Triton interpreter or the CPU. Each step is its own subprocess with its own time limit, so a
hang or crash loses only that step; the limits share ``--budget-s`` (default 1500 s) by weight, and time a step
leaves unused goes to the steps after it. Steps, in this order: env (always), e2e (the headline: first, and with
``--budget-s 560`` about 350 s of it; its GPU plan is sized to fit one 600 s device call - an estimate, not yet
measured: ~135 s on an H200), tests, sanitizer, kernels, quant, breakdown, then summary (always); ``--only`` picks
among e2e, tests, sanitizer, kernels, quant and breakdown (e.g. ``--only tests sanitizer kernels quant breakdown``
for a second call). At most 8 files in DIR:

  summary.md    the run as Markdown: device, versions, commit, each step's status / exit code / time, tables
  env.json      machine and versions, the CUDA probe, and the run record (steps, limits, layout)
  e2e.json      plain vs speculative tok/s (median of 5 runs, every request checked), acceptance, tau, c, v(k)
                through the engine's CUDA graphs, static-forward counters of every runner, at batch 1/8/64; fp32
                greedy identity
  profile.txt   torch.profiler of one speculative round at batch 8 (host waits counted by kind, top ops)
  tests.log     pytest -m gpu tests/gpu and tests/kernels -k "cuda and not gpu_compile", compiled for real, then
                compute-sanitizer memcheck over bench/gpu_steps/sanitize.py (every kernel once)
  kernels.json  bandwidth vs a measured device-to-device copy; paged attention vs SDPA (the backend that ran
                recorded) on contiguous KV; do_bench medians and CUDA-graph replay times (launch overhead apart);
                under "breakdown", the breakdown step's per-kernel-group GPU time of decode steps and a speculative
                round replayed from the engine's CUDA graphs, against their memory bound
  quant.json    int8 / int4 weight-only linears: the Triton kernel vs bf16 cuBLAS on Llama-3.2-1B/3B linears at
                1/5/16 rows (error vs its torch reference), engine plain decode bf16 / int8 / int4 and an int4
                self-draft
  steps.log     the env, e2e, kernels, quant and summary steps' output

``real`` (bench/gpu_steps/real.py: SmolLM2-135M's real weights, plain vs prompt lookup vs n-gram drafting on the
repository's prompts) is opt-in: it runs only when ``--only`` names it, in a call of its own (``--only real``: env,
real, summary; it writes real.json), after its weights have been carried to the machine in chunks
(bench/gpu_weights.py has the device calls).

``--dry-run`` runs the same steps on CPU (CUDA hidden, ``TRITON_INTERPRET=1``) with tiny shapes in seconds; what
needs CUDA says "skipped: no CUDA". Nothing but the standard library is imported here, so this file runs whatever
is installed.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
# name -> (weight: share of the budget, dry-run limit in seconds), in the order the steps run. With --budget-s 560
# e2e gets ~350 s (its GPU plan needs ~200-250 s; what it leaves goes to the others, then --only for the rest).
STEPS = {
    "env": (30, 60),
    "e2e": (1000, 240),
    "tests": (250, 120),
    "sanitizer": (100, 120),
    "kernels": (150, 120),
    "quant": (150, 120),
    "breakdown": (150, 120),
    "real": (500, 120),  # opt-in (OPT_IN): with --only real --budget-s 560 it gets ~490 s
    "summary": (40, 60),
}
OPTIONAL = ["e2e", "tests", "sanitizer", "kernels", "quant", "breakdown", "real"]
OPT_IN = ["real"]  # run only when --only names them (real needs its weights carried first: bench/gpu_weights.py)
ENV_FLOOR_S = 60.0  # importing torch and triton cold on a fresh VM
NO_CUDA = "not run: no CUDA (the orchestrator's probe found none); on a machine without a GPU use --dry-run"
LOGS = {"tests": "tests.log", "sanitizer": "tests.log"}  # the others append to steps.log (8 files at most)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m bench.gpu", description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, type=Path, help="result folder (at most 8 files are written)")
    parser.add_argument("--dry-run", action="store_true", help="CPU, tiny shapes, seconds per step")
    parser.add_argument("--only", nargs="+", choices=OPTIONAL, default=None,
                        help="run only these steps (env and summary always run)")
    parser.add_argument("--budget-s", type=float, default=None,
                        help="total seconds for all steps (default 1500; dry run: the sum of its step limits)")
    parser.add_argument("--alpha", type=float, nargs="+", default=[0.6, 0.7, 0.8],
                        help="acceptances for the projection in summary.md")
    parser.add_argument("--layout", choices=["auto", "site", "repo"], default="auto",
                        help="auto: a site folder iff specdec.kernels is not importable from the repo")
    return parser.parse_args(argv)


def inherited_pythonpath() -> list[str]:
    """The caller's PYTHONPATH entries made absolute (the steps run from another working directory)."""
    return [str(Path(p).resolve()) for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]


def kernels_importable(pythonpath: list[str], cwd: str) -> bool:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(pythonpath), "TRITON_INTERPRET": "1"}
    probe = subprocess.run([sys.executable, "-c", "import specdec.kernels, specdec.ops"], cwd=cwd, env=env,
                           capture_output=True, text=True, timeout=300)  # fmt: skip
    return probe.returncode == 0


def probe_cuda(env: dict, cwd: str, timeout: float = 240) -> dict:
    """Whether torch sees a GPU, asked by the orchestrator itself with a generous limit (a cold VM can take
    a minute to import torch and initialise CUDA). The env step only records facts; it never decides this.
    Returns ``{"available": bool, "seconds": float, "detail": str}``."""
    start = time.time()
    try:
        probe = subprocess.run([sys.executable, "-c", "import torch; print(torch.cuda.is_available())"], cwd=cwd,
                               env=env, capture_output=True, text=True, timeout=timeout)  # fmt: skip
    except subprocess.TimeoutExpired:
        return {"available": False, "seconds": round(time.time() - start, 1), "detail": f"timed out after {timeout} s"}
    available = probe.returncode == 0 and probe.stdout.strip().endswith("True")
    detail = probe.stdout.strip()[-200:] if probe.returncode == 0 else f"exit {probe.returncode}: {probe.stderr[-300:]}"
    return {"available": available, "seconds": round(time.time() - start, 1), "detail": detail}


def make_site() -> Path:
    """specdec/ with kernels/ as specdec/kernels/, as pyproject.toml's package-dir maps it on install."""
    site = Path(tempfile.mkdtemp(prefix="specdec_site_"))
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc")
    shutil.copytree(REPO / "specdec", site / "specdec", ignore=ignore)
    shutil.rmtree(site / "specdec" / "kernels", ignore_errors=True)
    shutil.copytree(REPO / "kernels", site / "specdec" / "kernels", ignore=ignore)
    return site


def run_step(name: str, cmd: list[str], env: dict, cwd: str, limit: float, log: Path) -> dict:
    """Run one step in its own process group; kill the group at ``limit``. Output appended to ``log``."""
    start = time.time()
    with tempfile.TemporaryFile("w+") as capture:
        proc = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=capture, stderr=subprocess.STDOUT,
                                start_new_session=True)  # fmt: skip
        try:
            rc = proc.wait(timeout=limit)
            timed_out = False
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            rc, timed_out = proc.wait(), True
        capture.seek(0)
        output = capture.read()
    seconds = round(time.time() - start, 1)
    with open(log, "a") as f:
        f.write(f"===== step {name}: {' '.join(cmd)} (limit {limit:.0f} s)\n{output}")
        f.write(f"===== step {name}: exit {rc}{' (killed at the time limit)' if timed_out else ''} in {seconds} s\n")
    notes = [line[len("STATUS:"):].strip() for line in output.splitlines() if line.startswith("STATUS:")]
    if timed_out:
        status = f"TIMEOUT after {limit:.0f} s (partial results kept)"
    elif rc != 0:
        status = f"FAILED (exit {rc})"
    else:
        status = notes[-1] if notes else "ok"
    return {"name": name, "status": status, "exit": rc, "seconds": seconds, "limit_s": round(limit)}


def sanitizer_cmd(step: list[str], env_info: dict, cuda: bool) -> tuple[list[str], str | None]:
    """The sanitizer step's command and the status to record when it is not the real thing."""
    if not cuda:
        return step, "skipped: no CUDA (the script ran on CPU through the Triton interpreter)"
    tool = env_info.get("compute_sanitizer")
    if not tool:
        return [sys.executable, "-c", "print('compute-sanitizer: not found')"], "not found"
    return [tool, "--tool", "memcheck", "--error-exitcode", "3", "--leak-check", "no", *step], None


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    out = args.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    stale_files = ["summary.md", "env.json", "kernels.json", "e2e.json", "quant.json", "profile.txt", "steps.log",
                   "real.json"]
    for stale in [*stale_files, *set(LOGS.values())]:
        (out / stale).unlink(missing_ok=True)
    selected = ["env", *(s for s in OPTIONAL if (s in args.only if args.only else s not in OPT_IN)), "summary"]
    budget = args.budget_s or (sum(STEPS[s][1] for s in selected) if args.dry_run else 1500.0)
    began = time.time()

    env = dict(os.environ, PYTHONUNBUFFERED="1")
    if args.dry_run:
        env.update(CUDA_VISIBLE_DEVICES="", TRITON_INTERPRET="1", OMP_NUM_THREADS="1")
    else:  # never the interpreter on a real run, whatever the caller's environment says
        env["TRITON_INTERPRET"] = "0"
    base = [str(REPO / "tests"), str(REPO)]
    scratch = tempfile.mkdtemp(prefix="specdec_gpu_cwd_")
    site = None
    layout = args.layout
    if layout == "auto":
        layout = "repo" if kernels_importable([*base, *inherited_pythonpath()], scratch) else "site"
    if layout == "site":
        site = make_site()
        base = [str(site), *base]
    env["PYTHONPATH"] = os.pathsep.join(dict.fromkeys([*base, *inherited_pythonpath()]))
    where = f"a site folder {site} (copy of specdec/ + kernels/)" if site else "the repository / its install"
    print(f"[bench.gpu] PYTHONPATH={env['PYTHONPATH']} ({where}); budget {budget:.0f} s; steps {selected}", flush=True)

    records: list[dict] = []
    env_info: dict = {}
    probe = {"available": False, "seconds": 0, "detail": "not probed: --dry-run hides CUDA"}
    if not args.dry_run:
        probe = probe_cuda(env, scratch)
    cuda = probe["available"]
    print(f"[bench.gpu] CUDA available (probed by the orchestrator): {cuda} ({probe['detail']}, {probe['seconds']} s)",
          flush=True)  # fmt: skip
    for i, name in enumerate(selected):
        if name in OPTIONAL and not args.dry_run and not cuda:
            records.append({"name": name, "status": NO_CUDA, "exit": None, "seconds": 0, "limit_s": None})
            print(f"[bench.gpu] {name}: {NO_CUDA}", flush=True)
            continue
        left = budget - (time.time() - began)
        weights = [STEPS[s][0] for s in selected[i:]]
        limit = max(10.0, left * STEPS[name][0] / sum(weights))
        if name == "env" and not args.dry_run:
            limit = max(limit, ENV_FLOOR_S)
        if args.dry_run:
            limit = min(limit, STEPS[name][1]) if args.budget_s else STEPS[name][1]
        module = "bench.gpu_steps.sanitize" if name == "sanitizer" else f"bench.gpu_steps.{name}"
        cmd = [sys.executable, "-m", module, "--out", str(out), "--deadline", f"{time.time() + limit - 5:.0f}"]
        if args.dry_run:
            cmd.append("--dry-run")
        if name == "summary":
            cmd += ["--alpha", *map(str, args.alpha)]
        step_env = dict(env)
        forced_status = None
        if name == "sanitizer":
            cmd, forced_status = sanitizer_cmd(cmd, env_info, cuda)
            step_env["PYTORCH_NO_CUDA_MEMORY_CACHING"] = "1"  # memcheck sees every allocation's real bounds
        if name == "summary":  # the run record goes into env.json first: the summary reads it
            write_run_record(out, env_info, records, args, budget, where)
        record = run_step(name, cmd, step_env, scratch, limit, out / LOGS.get(name, "steps.log"))
        if forced_status and record["exit"] == 0:
            record["status"] = forced_status
        print(f"[bench.gpu] {name}: {record['status']} ({record['seconds']} s)", flush=True)
        records.append(record)
        if name == "env":
            env_info = load_json(out / "env.json")
            env_info["cuda_probed_by_orchestrator"] = cuda
            env_info["cuda_probe"] = probe
        if name != "summary":  # if this process is killed (an outer time limit), the steps so far are on record
            write_run_record(out, env_info, records, args, budget, where)
            fallback_summary(out, records, "interrupted: the summary step has not run")
    write_run_record(out, env_info, records, args, budget, where)
    if records[-1]["exit"] != 0:
        fallback_summary(out, records, "the summary step failed: see steps.log")
    shutil.rmtree(scratch, ignore_errors=True)
    if site is not None:
        shutil.rmtree(site, ignore_errors=True)
    files = sorted(p.name for p in out.iterdir())
    print(f"[bench.gpu] wrote {len(files)} files to {out}: {', '.join(files)}", flush=True)
    return 0 if all(r["exit"] == 0 for r in records) else 1


def load_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}


def write_run_record(out: Path, env_info: dict, records: list[dict], args, budget: float, where: str) -> None:
    """The run (command, budget, layout, every step's status) goes into env.json, beside the machine facts."""
    info = {**env_info, "run": {
        "command": "python -m bench.gpu " + " ".join(sys.argv[1:]),
        "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
        "dry_run": args.dry_run, "budget_s": round(budget), "layout": where, "alpha": args.alpha,
        "steps": records + [{"name": s, "status": "skipped: not selected", "exit": None, "seconds": None,
                             "limit_s": None} for s in OPTIONAL if args.only is not None and s not in args.only],
    }}  # fmt: skip
    (out / "env.json").write_text(json.dumps(info, indent=1) + "\n")


def fallback_summary(out: Path, records: list[dict], why: str) -> None:
    """Until the summary step has run (or if it fails): at least the step table, in the same shape."""
    lines = [f"## GPU run ({why})", "", "| step | status | exit | seconds | limit (s) |",
             "|---|---|---|---|---|", *(f"| {r['name']} | {r['status']} | {r['exit']} | {r['seconds']} | "
                                        f"{r['limit_s']} |" for r in records)]  # fmt: skip
    (out / "summary.md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    sys.exit(main())
