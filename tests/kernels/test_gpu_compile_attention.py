"""GPU-readiness of the paged attention kernels without a GPU: compile them for sm_80 and sm_90 through the
launcher's own configuration choice (``launch_plan`` on ``meta`` tensors) and check spills (none inside a
loop) and shared memory.

Shapes: the Llama-3.2 / Qwen2.5 models the design targets, decode (q_len 1) and verification (q_len 2..9,
causal and tree), one and several KV splits, fp16, bf16 and fp32 (IEEE fp32 dots, not tf32), and batch-1
decodes whose default split rule shrinks BLOCK_N to 32. ``pytest -s`` prints the resource table.
The ``triton36`` test repeats the check with triton 3.6.0 (the GPU image's version) in its own venv.
"""

import os
import subprocess
import sys

import pytest
import torch
from gpu_compile import compile_reports, format_table, job_from_launch, job_key

from specdec.kernels import paged_attention as pa

MODULE = "specdec.kernels.paged_attention"
MODELS = {  # name: (Hq, Hkv, D)
    "Llama-3.2-1B": (32, 8, 64),
    "Llama-3.2-3B": (24, 8, 128),
    "Qwen2.5-0.5B": (14, 2, 64),
    "Qwen2.5-1.5B": (12, 2, 128),
}
ARCHS = (80, 90)
DTYPES = (torch.float16, torch.bfloat16, torch.float32)
Q_LENS = range(1, 10)  # decode, then k + 1 for k = 1..8 drafted tokens
BLOCK_SIZE = 16
NUM_SEQS = 4
MAX_BLOCKS = 64
# Every configuration is meant for sm_86/sm_89 too (99 KiB of shared memory per block there, 227 KiB on sm_90).
SHARED_LIMIT = 99 * 1024
# NOTE: no spill may sit inside a loop. Outside loops a few bytes are tolerated: ptxas sometimes caps registers
# at an occupancy step (128 per thread with 128 threads = 4 CTAs per SM) and parks one or two scalars (e.g. the
# tile's row count) in local memory across the whole KV loop instead - one store and one load per program.
COLD_SPILL_LIMIT = 16  # bytes per thread
WORKERS = 2


def _plan(hq, hkv, d, dtype, q_len, tree, num_splits, num_seqs=NUM_SEQS, max_blocks=MAX_BLOCKS):
    meta = torch.device("meta")
    tokens = num_seqs * q_len
    cache = (num_seqs * max_blocks, BLOCK_SIZE, hkv, d)
    tree_args = ()
    if tree:
        tree_args = (torch.empty(num_seqs * q_len**2, dtype=torch.bool, device=meta),
                     torch.empty(num_seqs + 1, dtype=torch.int32, device=meta))  # fmt: skip
    return pa.launch_plan(
        torch.empty(tokens, hq, d, dtype=dtype, device=meta),
        torch.empty(cache, dtype=dtype, device=meta),
        torch.empty(cache, dtype=dtype, device=meta),
        torch.empty(num_seqs, max_blocks, dtype=torch.int32, device=meta),
        torch.empty(num_seqs, dtype=torch.int32, device=meta),
        torch.empty(num_seqs + 1, dtype=torch.int32, device=meta),
        d**-0.5,
        *tree_args,
        num_splits=num_splits,
        interpret=False,
    )


def _plans():
    """(label, LaunchPlan) for every shape x dtype x mask x split variant, from the launcher's own choices."""
    for model, (hq, hkv, d) in MODELS.items():
        for dtype in DTYPES:
            for q_len in Q_LENS:
                for tree in (False, True) if q_len > 1 else (False,):
                    # NOTE: the split variant differs only in its epilogue (fp32 partial stores), which does not
                    # depend on the half dtype: compile it for fp16 (not bf16), to keep the compile count down; and
                    # for fp32, whose IEEE (FMA) dots compile to other register allocations.
                    for num_splits in (1, 4) if dtype != torch.bfloat16 else (1,):
                        yield f"{model} {str(dtype)[6:]} q_len={q_len}", _plan(hq, hkv, d, dtype, q_len, tree,
                                                                               num_splits)  # fmt: skip
            # Batch-1 decode at context 512 with the default split rule: many short splits, BLOCK_N shrunk to 32.
            plan = _plan(hq, hkv, d, dtype, 1, False, None, num_seqs=1, max_blocks=512 // BLOCK_SIZE)
            assert plan.reduce_grid is not None
            yield f"{model} {str(dtype)[6:]} batch 1 ctx 512 default splits", plan
        # The reduce kernel at the most splits the rule picks (SPLITS_PAD x D fp32 partial outputs in registers).
        yield f"{model} float16 {pa._MAX_SPLITS} splits", _plan(hq, hkv, d, torch.float16, 1, False, pa._MAX_SPLITS)


def _jobs():
    """Distinct compile jobs, and the first shape that needs each (for failure messages)."""
    jobs, labels = {}, {}
    for label, plan in _plans():
        for arch in ARCHS:
            launches = [("_paged_attention_kernel", plan.args, plan.constexprs, plan.num_warps, plan.num_stages)]
            if plan.reduce_grid is not None:
                launches.append(("_paged_attention_reduce_kernel", plan.reduce_args, plan.reduce_constexprs, 4, 1))
            for kernel, args, constexprs, num_warps, num_stages in launches:
                job = job_from_launch(MODULE, kernel, args, constexprs, num_warps, num_stages, arch)
                jobs.setdefault(job_key(job), job)
                labels.setdefault(job_key(job), label)
    return list(jobs.values()), [labels[k] for k in jobs]


def _check(python: str = sys.executable) -> None:
    jobs, labels = _jobs()
    reports = compile_reports(jobs, workers=WORKERS, python=python)
    errors = [f"{lb} {j.kernel} sm_{j.arch}:\n{r['error']}" for j, lb, r in zip(jobs, labels, reports) if r["error"]]
    assert not errors, "\n\n".join(errors)
    columns = ["kernel", "dtype", "HEAD_DIM", "GROUP", "BLOCK_M", "BLOCK_Q", "BLOCK_N", "TREE", "SPLIT", "SPLITS_PAD"]
    for r in reports:
        r["kernel"] = "reduce" if "reduce" in r["kernel"] else "main"
        r["dtype"] = r["signature"]["out_ptr"].removeprefix("*")
    print(f"\npaged attention, {len(jobs)} distinct compiles (triton at {python}):")
    print(format_table(sorted(reports, key=lambda r: [str(r["constexprs"].get(c, "")) for c in columns[1:]]),
                       columns))  # fmt: skip
    bad = [
        f"{lb} {j.kernel} sm_{j.arch} {j.constexprs}: spills {r['spill_stores']}/{r['spill_loads']} B "
        f"({r['loop_local_accesses']} in loops), shared {r['shared']} B"
        for j, lb, r in zip(jobs, labels, reports)
        if r["loop_local_accesses"] or max(r["spill_stores"], r["spill_loads"]) > COLD_SPILL_LIMIT
        or r["shared"] > SHARED_LIMIT
    ]
    assert not bad, "spills or too much shared memory:\n" + "\n".join(bad)


def test_attention_compiles_for_sm80_sm90_without_hot_spills():
    _check()


def test_configs_cover_every_shape_with_legal_tiles():
    """Cheap invariants of the configuration choice itself (the compile test checks the rest)."""
    for hq, hkv, d in MODELS.values():
        group = hq // hkv
        for q_len in Q_LENS:
            for dtype in DTYPES:
                for cfg in pa.attention_configs(d, group, q_len, dtype):
                    c = cfg.constexprs
                    assert c["BLOCK_M"] >= 16 and c["BLOCK_N"] >= 16 and c["BLOCK_N_MASKED"] >= 16  # tl.dot minimum
                    assert 1 <= c["BLOCK_Q"] and c["BLOCK_Q"] * group <= c["BLOCK_M"]
                    assert c["BLOCK_N"] % c["BLOCK_N_MASKED"] == 0


TRITON36_VENV = os.path.join(os.path.dirname(__file__), "..", "..", ".venv-triton36")


@pytest.mark.triton36
def test_attention_compiles_with_triton_3_6():
    """Same compile check with triton 3.6.0 (the GPU image's version), in a venv beside the repo.

    The venv sees this interpreter's site-packages (torch, the editable specdec) and overrides triton and numpy.
    """
    python = os.path.join(TRITON36_VENV, "bin", "python")
    if not os.path.exists(python):
        subprocess.run([sys.executable, "-m", "venv", "--system-site-packages", TRITON36_VENV], check=True)
        subprocess.run([python, "-m", "pip", "install", "-q", "triton==3.6.0", "numpy<2.4"], check=True)
    version = subprocess.run([python, "-c", "import triton; print(triton.__version__)"], capture_output=True,
                             text=True, check=True).stdout.strip()  # fmt: skip
    assert version == "3.6.0", version
    _check(python)
