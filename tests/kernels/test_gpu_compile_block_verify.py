"""GPU-readiness of the block verification kernel: compiles for sm_80 and sm_90 without a GPU, no spills.

Same launches as tests/kernels/test_gpu_compile_spec_sample.py (the two kernels share the launcher's config, the
arguments and their layout): real vocabularies (SmolLM 49152, Llama-3 128256, Qwen2 151936), with and without
draft probabilities (all one-hot batches compile the token-wise branch only), batch 64 with 8 drafts per request.
"""

from __future__ import annotations

from gpu_compile import assert_compiles_without_spills
from test_gpu_compile_spec_sample import ARCHS, COLUMNS, MAX_SHARED, chain_launches


def test_block_verify_compiles_without_spills():
    assert_compiles_without_spills("specdec.kernels.block_verify", "_block_verify_kernel", chain_launches(), COLUMNS,
                                   ARCHS, MAX_SHARED)  # fmt: skip
