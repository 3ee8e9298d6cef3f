"""GPU-readiness of the block verification kernel: compiles for sm_80 and sm_90 without a GPU, no spills.

Same launches as tests/kernels/test_gpu_compile_spec_sample.py (the two kernels share the launcher's config, the
arguments and their layout): real vocabularies (SmolLM 49152, Llama-3 128256, Qwen2 151936), with and without
draft probabilities (all one-hot batches compile the token-wise branch only), batch 64 with 8 drafts per request.
"""

from __future__ import annotations

import triton
from gpu_compile import compile_reports, format_table, job_from_launch
from test_gpu_compile_spec_sample import ARCHS, MAX_K, MAX_SHARED, VOCABS, launch_args

from specdec.kernels.spec_sample import spec_sample_config


def test_block_verify_compiles_without_spills():
    labels, jobs = [], []
    for vocab in VOCABS:
        config = spec_sample_config(vocab)  # the launcher's own choice (block_verify uses it too)
        for has_draft_probs in (True, False):
            constexprs = {"HAS_DRAFT_PROBS": has_draft_probs, "BLOCK_V": config.block_v,
                          "BLOCK_K": triton.next_power_of_2(MAX_K + 1)}  # fmt: skip
            for arch in ARCHS:
                labels.append(vocab)
                jobs.append(job_from_launch("specdec.kernels.block_verify", "_block_verify_kernel",
                                            launch_args(vocab, has_draft_probs), constexprs, config.num_warps, 3,
                                            arch))  # fmt: skip
    reports = [dict(report, vocab=vocab) for vocab, report in zip(labels, compile_reports(jobs, workers=2))]
    print("\n" + format_table(reports, ["vocab", "HAS_DRAFT_PROBS", "BLOCK_V", "BLOCK_K"]))
    for report in reports:
        where = f"vocab {report['vocab']} sm_{report['arch']} HAS_DRAFT_PROBS={report['constexprs']['HAS_DRAFT_PROBS']}"
        assert report["error"] is None, f"{where}:\n{report['error']}"
        assert report["spill_stores"] == 0 and report["spill_loads"] == 0, f"{where}: spills"
        assert report["shared"] <= MAX_SHARED, f"{where}: {report['shared']} bytes of shared memory"
