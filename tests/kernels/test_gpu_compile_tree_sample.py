"""GPU-readiness of the tree verification kernel: compiles for sm_80 and sm_90 without a GPU, no spills.

The configurations come from the launcher's own ``tree_sample_config`` for real vocabularies (SmolLM 49152,
Llama-3 128256, Qwen2 151936), with and without draft probabilities (one-hot drafters compile the other branch).
Argument types and 16-divisibility come from ``job_from_launch`` on meta tensors shaped like a real launch
(batch 64, trees of 16 nodes, depth 6), as Triton's own launcher would derive them.
"""

from __future__ import annotations

import torch
import triton
from gpu_compile import assert_compiles_without_spills, verification_launches

from specdec.kernels.tree_sample import tree_sample_config

VOCABS = (49152, 128256, 151936)
ARCHS = (80, 90)
MAX_SHARED = 160 * 1024
BATCH, NODES, MAX_DEPTH = 64, 16, 6


def launch_args(vocab: int, has_draft_probs: bool) -> dict:
    """The kernel arguments ``tree_sample`` passes, as meta tensors (only dtype and alignment matter)."""
    def meta(*shape, dtype):
        return torch.empty(*shape, dtype=dtype, device="meta")

    num_nodes = BATCH * NODES
    target_probs = meta(num_nodes, vocab, dtype=torch.float32)
    return {
        "out_ptr": meta(BATCH, MAX_DEPTH + 1, dtype=torch.int64),
        "num_accepted_ptr": meta(BATCH, dtype=torch.int32),
        "accepted_nodes_ptr": meta(BATCH, MAX_DEPTH, dtype=torch.int32),
        "token_ids_ptr": meta(num_nodes, dtype=torch.int64),
        "parents_ptr": meta(num_nodes, dtype=torch.int32),
        "cu_ptr": meta(BATCH + 1, dtype=torch.int32),
        "draft_probs_ptr": meta(num_nodes, vocab, dtype=torch.float32) if has_draft_probs else target_probs,
        "target_probs_ptr": target_probs,
        "target_argmax_ptr": meta(num_nodes, dtype=torch.int64),
        "is_greedy_ptr": meta(BATCH, dtype=torch.bool),
        "onehot_ptr": meta(BATCH, dtype=torch.bool),
        "seeds_ptr": meta(BATCH, dtype=torch.int64),
        "positions_ptr": meta(BATCH, dtype=torch.int64),
        "excluded_ptr": meta(num_nodes, dtype=torch.int64),
        "max_depth": MAX_DEPTH,
        "vocab_size": vocab,
    }


def test_tree_sample_compiles_without_spills():
    launches = verification_launches(VOCABS, tree_sample_config, launch_args,
                                     BLOCK_D=triton.next_power_of_2(MAX_DEPTH + 1))  # fmt: skip
    assert_compiles_without_spills("specdec.kernels.tree_sample", "_tree_sample_kernel", launches,
                                   ["vocab", "HAS_DRAFT_PROBS", "BLOCK_V", "BLOCK_D"], ARCHS, MAX_SHARED)  # fmt: skip
