"""GPU-readiness of the speculative verification kernel: compiles for sm_80 and sm_90 without a GPU, no spills.

The configurations come from the launcher's own ``spec_sample_config`` for real vocabularies (SmolLM 49152,
Llama-3 128256, Qwen2 151936), with and without draft probabilities (one-hot drafters compile the other branch).
Argument types and 16-divisibility come from ``job_from_launch`` on meta tensors shaped like a real launch
(batch 64, 8 drafts per request), as Triton's own launcher would derive them.
"""

from __future__ import annotations

import torch
import triton
from gpu_compile import assert_compiles_without_spills, verification_launches

from specdec.kernels.spec_sample import spec_sample_config

VOCABS = (49152, 128256, 151936)
ARCHS = (80, 90)
MAX_SHARED = 160 * 1024
COLUMNS = ["vocab", "HAS_DRAFT_PROBS", "BLOCK_V", "BLOCK_K"]
BATCH, MAX_K = 64, 8


def launch_args(vocab: int, has_draft_probs: bool) -> dict:
    """The kernel arguments ``spec_sample`` passes, as meta tensors (only dtype and alignment matter)."""
    def meta(*shape, dtype):
        return torch.empty(*shape, dtype=dtype, device="meta")

    num_total = BATCH * MAX_K
    target_probs = meta(num_total + BATCH, vocab, dtype=torch.float32)
    return {
        "out_ptr": meta(BATCH, MAX_K + 1, dtype=torch.int64),
        "num_accepted_ptr": meta(BATCH, dtype=torch.int32),
        "draft_ids_ptr": meta(num_total, dtype=torch.int64),
        "cu_ptr": meta(BATCH + 1, dtype=torch.int32),
        "draft_probs_ptr": meta(num_total, vocab, dtype=torch.float32) if has_draft_probs else target_probs,
        "target_probs_ptr": target_probs,
        "target_argmax_ptr": meta(num_total + BATCH, dtype=torch.int64),
        "is_greedy_ptr": meta(BATCH, dtype=torch.bool),
        "onehot_ptr": meta(BATCH, dtype=torch.bool),
        "seeds_ptr": meta(BATCH, dtype=torch.int64),
        "positions_ptr": meta(BATCH, dtype=torch.int64),
        "max_num_draft_tokens": MAX_K,
        "vocab_size": vocab,
    }


def chain_launches():
    """spec_sample's launches (block_verify shares them: same config, arguments and layout)."""
    return verification_launches(VOCABS, spec_sample_config, launch_args, BLOCK_K=triton.next_power_of_2(MAX_K + 1))


def test_spec_sample_compiles_without_spills():
    assert_compiles_without_spills("specdec.kernels.spec_sample", "_spec_sample_kernel", chain_launches(), COLUMNS,
                                   ARCHS, MAX_SHARED)  # fmt: skip
