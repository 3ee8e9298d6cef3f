"""GPU-readiness of the KV compaction kernel without a GPU: both launches (gather into the workspace, scatter to
the caches) compile for sm_80 and sm_90 with the launcher's own tiles, for the pool shapes of the Llama-3.2 /
Qwen2.5 models and every element width (fp32 and fp16/bf16 caches are moved as int32 / int16), with no spills.
Argument types and 16-divisibility come from ``job_from_launch`` on meta tensors shaped like a real call."""

from __future__ import annotations

import torch
from gpu_compile import compile_reports, format_table, job_from_launch

from specdec.kernels.kv_compact import _rows, copy_rows_launch

MODELS = {  # name: (layers, Hkv, D)
    "Llama-3.2-1B": (16, 8, 64),
    "Llama-3.2-3B": (28, 8, 128),
    "Qwen2.5-0.5B": (24, 2, 64),
    "Qwen2.5-1.5B": (28, 2, 128),
}
ARCHS = (80, 90)
NUM_BLOCKS, BLOCK_SIZE = 4096, 16
NUM_MOVES = 64 * 8  # batch 64, an accepted path of 8 per request


def _launches(layers, hkv, d, dtype):
    meta = torch.device("meta")
    cache = _rows(torch.empty(layers, NUM_BLOCKS, BLOCK_SIZE, hkv, d, dtype=dtype, device=meta))  # [L, S, W]
    workspace = torch.empty(layers, NUM_MOVES, hkv * d, dtype=cache.dtype, device=meta)
    slots = torch.empty(NUM_MOVES, dtype=torch.int64, device=meta)
    return {"gather": copy_rows_launch(cache, workspace, slots, None),
            "scatter": copy_rows_launch(workspace, cache, None, slots)}  # fmt: skip


def test_kv_compact_compiles_without_spills():
    jobs, labels = [], []
    for model, shape in MODELS.items():
        for dtype in (torch.float32, torch.bfloat16):
            for phase, (_, args, constexprs, num_warps) in _launches(*shape, dtype).items():
                for arch in ARCHS:
                    labels.append(f"{model} {str(dtype)[6:]} {phase}")
                    jobs.append(job_from_launch("specdec.kernels.kv_compact", "_kv_copy_rows_kernel", args,
                                                constexprs, num_warps, 3, arch))  # fmt: skip  (3: the launch default)
    reports = [dict(r, label=label) for label, r in zip(labels, compile_reports(jobs, workers=2), strict=True)]
    print("\n" + format_table(reports, ["label", "BLOCK_T", "BLOCK_W", "INDEX_IN", "INDEX_OUT"]))
    for r in reports:
        where = f"{r['label']} sm_{r['arch']}"
        assert r["error"] is None, f"{where}:\n{r['error']}"
        assert r["spill_stores"] == 0 and r["spill_loads"] == 0, f"{where}: spills"
        assert r["shared"] <= 99 * 1024, f"{where}: {r['shared']} bytes of shared memory"
