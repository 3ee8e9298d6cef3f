"""Compile Triton kernels for NVIDIA GPUs on a machine without one, and report their resource usage.

The triton wheel ships ``ptxas`` and ``cuobjdump``, so ``triton.compile`` can build a cubin for any sm_XX
here. That catches what the interpreter lets through (a ``tl.dot`` with K < 16, Python ``break`` or lists)
and tells registers, spills and shared memory per configuration. Compiles run in subprocesses without
``TRITON_INTERPRET`` (pytest's conftest sets it process-wide, and triton reads it at import).

Usage from a test - either describe the launch by its argument values (types and specialisations derived the
way Triton's launcher derives them; ``meta`` tensors are fine)::

    from tests.kernels.gpu_compile import compile_reports, job_from_launch

    args = {"x_ptr": torch.empty(4096, 4096, device="meta", dtype=torch.float16), "n_cols": 4096, "eps": 1e-6}
    jobs = [job_from_launch("specdec.kernels.my_op", "_my_kernel", args, {"BLOCK": 1024}, 4, 2, arch)
            for arch in (80, 90)]

or write the signature yourself (``make_signature`` fills in ``*_ptr`` pointers and i32 scalars)::

    sig = make_signature(module._my_kernel, constexprs, pointer_type="*fp16", types={"eps": "fp32"})
    jobs = [CompileJob("specdec.kernels.my_op", "_my_kernel", sig, constexprs, 4, 2, arch, pointer_args(sig))]

then::

    for report in compile_reports(jobs, workers=2):
        assert report["error"] is None, report["error"]
        assert report["spill_stores"] == 0 and report["spill_loads"] == 0  # or: report["loop_local_accesses"] == 0
        assert report["shared"] <= 99 * 1024

A report is a dict: the job's fields, plus ``registers`` (per thread, from ``cuobjdump --dump-resource-usage``
on the cubin), ``stack`` and ``local`` (bytes per thread; ``stack == 0`` proves there is no spill),
``spill_stores`` / ``spill_loads`` (bytes, from ``ptxas -v`` on the PTX, run only when the stack is not 0:
a small stack frame can hold non-spilled data), ``loop_local_accesses`` (spill instructions inside a loop of
the SASS: 0 means any spill is cold - ptxas sometimes caps registers at an occupancy step, e.g. 128, and parks a
scalar in local memory for the whole loop instead), ``shared`` (bytes per program, from the compiled metadata),
``seconds`` and ``error`` (None, or the compile traceback - a failing job never hides the others).

Run as a script, this file is the subprocess worker: a JSON list of jobs on stdin, a JSON list of reports on
stdout.
"""

from __future__ import annotations

import dataclasses
import importlib
import inspect
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterable, Sequence
from typing import Any


@dataclasses.dataclass(frozen=True)
class CompileJob:
    module: str  # importable module that defines the kernel, e.g. "specdec.kernels.paged_attention"
    kernel: str  # name of the @triton.jit function in that module
    signature: dict[str, str]  # every non-constexpr argument -> Triton type: "*fp16", "*i32", "i32", "fp32"...
    constexprs: dict[str, Any]  # every constexpr argument -> value (int / bool / float / None)
    num_warps: int = 4
    num_stages: int = 3
    arch: int = 90  # compute capability: 80 (A100), 86/89 (consumer Ampere/Ada), 90 (H100/H200)
    # Arguments a real launch would specialise as 16-divisible (pointers are 16-byte aligned from torch's
    # allocator; ints that are multiples of 16). This changes vectorisation, so it changes register counts.
    divisible_by_16: tuple[str, ...] = ()
    # Triton's compile option of that name: False where the launcher passes it (a kernel that must round as torch
    # does, e.g. kernels/rope_kv.py). The report counts the PTX's fused multiply-adds (``fma_count``).
    enable_fp_fusion: bool = True


def arg_names(kernel) -> list[str]:
    """Argument names of a @triton.jit function, whether it was built compiled or interpreted."""
    return list(inspect.signature(getattr(kernel, "fn", kernel)).parameters)


def make_signature(
    kernel,
    constexprs: dict[str, Any],
    pointer_type: str,
    types: dict[str, str] | None = None,
    scalar_type: str = "i32",
) -> dict[str, str]:
    """Signature for :class:`CompileJob`: ``types`` wins, then ``*_ptr`` arguments get ``pointer_type`` and the
    other non-constexpr arguments ``scalar_type``."""
    types = types or {}
    unknown = set(types) - set(arg_names(kernel))
    if unknown:
        raise ValueError(f"types names arguments the kernel does not have: {sorted(unknown)}")
    sig = {}
    for name in arg_names(kernel):
        if name in constexprs:
            continue
        sig[name] = types.get(name, pointer_type if name.endswith("_ptr") else scalar_type)
    return sig


def job_from_launch(
    module: str,
    kernel_name: str,
    args: dict[str, Any],
    constexprs: dict[str, Any],
    num_warps: int,
    num_stages: int,
    arch: int,
    do_not_specialize: Iterable[str] | None = None,
    enable_fp_fusion: bool = True,
) -> CompileJob:
    """The job a real launch ``kernel[grid](**args, **constexprs)`` would compile: argument types and the
    16-divisibility / ``== 1`` specialisations are derived from the values the way Triton's launcher derives
    them. ``args`` may hold ``meta`` tensors (only dtype and alignment are read). ``do_not_specialize``
    defaults to the kernel's own list.
    """
    kernel = getattr(importlib.import_module(module), kernel_name)
    if do_not_specialize is None:
        do_not_specialize = getattr(kernel, "do_not_specialize", None) or getattr(kernel, "kwargs", {}).get(
            "do_not_specialize", ()
        )
    names = arg_names(kernel)
    frozen = {names[i] if isinstance(i, int) else i for i in do_not_specialize}
    missing = set(names) - set(args) - set(constexprs)
    if missing:
        raise ValueError(f"no value for kernel arguments {sorted(missing)}")
    signature, divisible, constexprs = {}, [], dict(constexprs)
    for name in names:
        if name in constexprs:
            continue
        ty, key = _specialize(args[name], specialize=name not in frozen)
        if ty == "constexpr":
            constexprs[name] = key
        else:
            signature[name] = ty
            if key == "D":
                divisible.append(name)
    return CompileJob(module, kernel_name, signature, constexprs, num_warps, num_stages, arch, tuple(divisible),
                      enable_fp_fusion)


_POINTER_TYPES = {"float16": "fp16", "bfloat16": "bf16", "float32": "fp32", "float64": "fp64", "bool": "u1",
                  "uint8": "u8", "int8": "i8", "int16": "i16", "int32": "i32", "int64": "i64"}  # fmt: skip


def _specialize(value: Any, specialize: bool) -> tuple[str, Any]:
    """(Triton type, specialisation key) of an argument value: "D" = divisible by 16 / 16-byte aligned."""
    try:  # Triton's own rule (triton >= 3.4)
        from triton._C.libtriton import native_specialize_impl
        from triton.backends.compiler import BaseBackend

        return native_specialize_impl(BaseBackend, value, False, specialize, True)[:2]
    except ImportError:
        pass
    if hasattr(value, "data_ptr"):
        ty = _POINTER_TYPES[str(value.dtype).removeprefix("torch.")]
        return "*" + ty, "D" if specialize and value.data_ptr() % 16 == 0 else ""
    if isinstance(value, bool):
        return "u1", None
    if isinstance(value, int):
        if specialize and value == 1:
            return "constexpr", 1
        ty = "i32" if -(2**31) <= value < 2**31 else "i64"
        return ty, ("D" if value % 16 == 0 else "") if specialize else None
    if isinstance(value, float):
        return "fp32", None
    raise TypeError(f"cannot derive a Triton type for {type(value).__name__}")


def pointer_args(signature: dict[str, str]) -> tuple[str, ...]:
    """The pointer arguments of a signature (torch allocations are 16-byte aligned: pass as divisible_by_16)."""
    return tuple(name for name, ty in signature.items() if ty.startswith("*"))


def compile_reports(
    jobs: Sequence[CompileJob], workers: int = 1, python: str = sys.executable, timeout: float = 1800
) -> list[dict]:
    """Compile every job in ``workers`` parallel subprocesses (``python`` may be another venv's interpreter).

    Returns one report per job, in order. Duplicate jobs are compiled once.
    """
    unique = list(dict.fromkeys(job_key(j) for j in jobs))
    chunks = [unique[i::workers] for i in range(max(1, min(workers, len(unique))))]
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    procs = [
        subprocess.Popen(
            [python, os.path.abspath(__file__)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            env=env,
            text=True,
        )
        for _ in chunks
    ]
    results: dict[str, dict] = {}
    for proc, chunk in zip(procs, chunks):
        stdout, stderr = proc.communicate(json.dumps([json.loads(k) for k in chunk]), timeout=timeout)
        if proc.returncode != 0:
            raise RuntimeError(f"compile worker failed (rc {proc.returncode}):\n{stderr[-4000:]}")
        for key, report in zip(chunk, json.loads(stdout)):
            results[key] = report
    return [results[job_key(j)] for j in jobs]


def compile_report(
    module_name: str,
    kernel_name: str,
    signature: dict[str, str],
    constexprs: dict[str, Any],
    num_warps: int,
    num_stages: int,
    arch: int,
    divisible_by_16: Iterable[str] = (),
) -> dict:
    """Compile one kernel configuration in a subprocess; see the module docstring for the report."""
    job = CompileJob(
        module_name, kernel_name, signature, constexprs, num_warps, num_stages, arch, tuple(divisible_by_16)
    )
    return compile_reports([job])[0]


def format_table(reports: Sequence[dict], columns: Sequence[str]) -> str:
    """A fixed-width text table: the given constexpr (or job field) columns, then arch, warps, stages and usage."""
    header = [*columns, "arch", "warps", "stages", "regs", "stack", "spill_st", "spill_ld", "in_loop", "shared_KiB"]
    rows = []
    for r in reports:
        values = [r["constexprs"].get(c, r.get(c, "")) for c in columns]
        usage = ["ERROR", "", "", "", "", ""]
        if r["error"] is None:
            usage = [r["registers"], r["stack"], r["spill_stores"], r["spill_loads"], r["loop_local_accesses"],
                     f"{r['shared'] / 1024:.1f}"]  # fmt: skip
        rows.append([str(v) for v in [*values, f"sm_{r['arch']}", r["num_warps"], r["num_stages"], *usage]])
    widths = [max(len(h), *(len(row[i]) for row in rows)) for i, h in enumerate(header)]
    lines = ["  ".join(h.rjust(w) for h, w in zip(header, widths))]
    lines += ["  ".join(v.rjust(w) for v, w in zip(row, widths)) for row in rows]
    return "\n".join(lines)


def verification_launches(vocabs: Iterable[int], config_fn, launch_args, **constexprs) -> list[tuple]:
    """The launches of a speculative verification kernel (spec_sample, block_verify, tree_sample) for
    :func:`assert_compiles_without_spills`: per vocabulary, the launcher's own ``config_fn(vocab)`` (``block_v``,
    ``num_warps``), with and without draft probabilities (one-hot drafters compile the other branch).
    ``launch_args(vocab, has_draft_probs)`` gives the kernel arguments; ``constexprs`` the other constexprs."""
    launches = []
    for vocab in vocabs:
        config = config_fn(vocab)
        for has_draft_probs in (True, False):
            consts = {"HAS_DRAFT_PROBS": has_draft_probs, "BLOCK_V": config.block_v, **constexprs}
            launches.append(({"vocab": vocab}, launch_args(vocab, has_draft_probs), consts, config.num_warps))
    return launches


def assert_compiles_without_spills(
    module: str,
    kernel: str,
    launches: Iterable[tuple[dict, dict, dict, int]],
    columns: Sequence[str],
    archs: Iterable[int] = (80, 90),
    max_shared: int = 160 * 1024,
) -> None:
    """Compile ``module.kernel`` for every launch ``(labels, args, constexprs, num_warps)`` (``job_from_launch``'s
    arguments, 3 stages) on every arch; print the table (``columns``: labels / constexprs) and assert each compiles
    with no spill and at most ``max_shared`` bytes of shared memory."""
    labels, jobs = [], []
    for label, args, constexprs, num_warps in launches:
        for arch in archs:
            labels.append(label)
            jobs.append(job_from_launch(module, kernel, args, constexprs, num_warps, 3, arch))
    # identical jobs (e.g. vocabularies that share a config) are compiled once and share a report: copy to label
    reports = [dict(report, **label) for label, report in zip(labels, compile_reports(jobs, workers=2))]
    print("\n" + format_table(reports, columns))
    for report in reports:
        where = " ".join(f"{c}={report['constexprs'].get(c, report.get(c))}" for c in columns)
        where = f"{where} sm_{report['arch']}"
        assert report["error"] is None, f"{where}:\n{report['error']}"
        assert report["spill_stores"] == 0 and report["spill_loads"] == 0, f"{where}: spills"
        assert report["shared"] <= max_shared, f"{where}: {report['shared']} bytes of shared memory"


def job_key(job: CompileJob) -> str:
    """A hashable identity of a job (jobs hold dicts, so they are not hashable themselves)."""
    d = dataclasses.asdict(job)
    d["divisible_by_16"] = sorted(d["divisible_by_16"])
    return json.dumps(d, sort_keys=True)


# ----------------------------------------------------------------------------------------- worker side


def _compile_one(job: dict) -> dict:
    import triton
    from triton.backends.compiler import GPUTarget

    start = time.perf_counter()
    report = {**job, "registers": None, "stack": None, "local": None, "spill_stores": None, "spill_loads": None,
              "fma_count": None,
              "loop_local_accesses": None}  # fmt: skip
    report.update(shared=None, error=None)
    try:
        kernel = getattr(importlib.import_module(job["module"]), job["kernel"])
        names = arg_names(kernel)
        signature = {name: ("constexpr" if name in job["constexprs"] else job["signature"][name]) for name in names}
        attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in job["divisible_by_16"]}
        src = triton.compiler.ASTSource(fn=kernel, signature=signature, constexprs=job["constexprs"], attrs=attrs)
        ck = triton.compile(
            src,
            target=GPUTarget("cuda", job["arch"], 32),
            options={"num_warps": job["num_warps"], "num_stages": job["num_stages"],
                     "enable_fp_fusion": job.get("enable_fp_fusion", True)},
        )
        report["fma_count"] = len(re.findall(r"\bfma\.", ck.asm["ptx"]))
        report["shared"] = int(ck.metadata.shared)
        bin_dir = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
        report.update(_resource_usage(ck.asm["cubin"], bin_dir))
        if report["stack"]:
            report.update(_spills(ck.asm["ptx"], job["arch"], bin_dir))
            report["loop_local_accesses"] = _loop_local_accesses(ck.asm["cubin"], bin_dir)
    except Exception:  # noqa: BLE001 - the report carries the traceback; other jobs go on
        import traceback

        report["error"] = traceback.format_exc()[-4000:]
    report["seconds"] = round(time.perf_counter() - start, 2)
    return report


def _resource_usage(cubin: bytes, bin_dir: str) -> dict:
    """Registers and stack/local bytes per thread of the cubin, from ``cuobjdump --dump-resource-usage``."""
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        cmd = [os.path.join(bin_dir, "cuobjdump"), "--dump-resource-usage", f.name]
        text = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
    match = re.search(r"REG:(\d+)\s+STACK:(\d+)\s+SHARED:(\d+)\s+LOCAL:(\d+)", text)
    if match is None:
        raise RuntimeError(f"unexpected cuobjdump output:\n{text}")
    stack = int(match[2])
    # STACK:0 proves there is no spill; a non-zero stack frame is looked into by _spills.
    return {"registers": int(match[1]), "stack": stack, "local": int(match[4]), "spill_stores": 0, "spill_loads": 0,
            "loop_local_accesses": 0}  # fmt: skip


def _loop_local_accesses(cubin: bytes, bin_dir: str) -> int:
    """Local-memory instructions (STL/LDL: spills) inside a loop of the SASS, i.e. between a backward branch
    and its target. 0 means every spill is cold: stored once before the loops and reloaded once after."""
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        sass = subprocess.run([os.path.join(bin_dir, "cuobjdump"), "-sass", f.name], capture_output=True, text=True,
                              check=True).stdout  # fmt: skip
    insts = [(int(m[1], 16), m[2]) for m in re.finditer(r"/\*([0-9a-f]{4,})\*/\s+(.*?);", sass)]
    loops = []
    for addr, text in insts:
        branch = re.search(r"\bBRA\b.*?0x([0-9a-f]+)", text)
        if branch and int(branch[1], 16) <= addr:
            loops.append((int(branch[1], 16), addr))
    local = [addr for addr, text in insts if re.search(r"\b(STL|LDL)\b", text)]
    return sum(any(lo <= a <= hi for lo, hi in loops) for a in local)


def _spills(ptx: str, arch: int, bin_dir: str) -> dict:
    """Spill store/load bytes from ``ptxas -v`` on the kernel's PTX (a stack frame can also hold non-spills)."""
    gpu = f"sm_{arch}a" if arch >= 90 else f"sm_{arch}"
    with tempfile.TemporaryDirectory() as tmp:
        src = os.path.join(tmp, "k.ptx")
        with open(src, "w") as f:
            f.write(ptx)
        cmd = [os.path.join(bin_dir, "ptxas"), "-lineinfo", "-v", f"--gpu-name={gpu}", src, "-o", src + ".o"]
        log = subprocess.run(cmd, capture_output=True, text=True, check=True).stderr
    match = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", log)
    if match is None:
        raise RuntimeError(f"unexpected ptxas -v output:\n{log}")
    return {"spill_stores": int(match[1]), "spill_loads": int(match[2])}


def _main() -> None:
    if os.environ.get("TRITON_INTERPRET") == "1":
        raise RuntimeError("the compile worker must run without TRITON_INTERPRET=1")
    jobs = json.load(sys.stdin)
    json.dump([_compile_one(job) for job in jobs], sys.stdout)


if __name__ == "__main__":
    _main()
