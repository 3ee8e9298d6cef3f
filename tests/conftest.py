"""Test-wide setup. Without a CUDA device, TRITON_INTERPRET=1 must be set before anything imports triton
(TRITON_ON_CPU.md); with one, kernels run compiled (the variable is left as the environment has it).

``import torch`` does not import triton, so CUDA is probed first; if triton is already in ``sys.modules`` on a
machine without CUDA and the interpreter was not asked for, it is too late to ask: stop with a clear error.
"""

import os
import sys

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

import torch  # noqa: E402

HAS_CUDA = torch.cuda.is_available()
if not HAS_CUDA:
    if "triton" in sys.modules and os.environ.get("TRITON_INTERPRET") != "1":
        raise RuntimeError("triton was imported before tests/conftest.py could set TRITON_INTERPRET=1")
    os.environ.setdefault("TRITON_INTERPRET", "1")

# Two threads on a two-core machine with a busy neighbour run up to 50x slower than one.
torch.set_num_threads(1)


import pytest  # noqa: E402


@pytest.fixture(scope="session")
def tiny_pair(tmp_path_factory):
    """(target, draft) folders: a tiny random llama and a perturbed copy of it (acceptance strictly in (0, 1))."""
    from tiny_models import make_tiny_model

    target = str(tmp_path_factory.mktemp("pair_target"))
    draft = str(tmp_path_factory.mktemp("pair_draft"))
    make_tiny_model(target, "llama", seed=3)
    make_tiny_model(draft, "llama", seed=3, perturb_from=target, perturb_scale=0.15)
    return target, draft


@pytest.fixture(scope="session")
def tiny_pair_plain(tiny_pair):
    """Plain (target-only) LLM of ``tiny_pair``'s target (small KV pool): the reference of greedy comparisons."""
    from helpers import small_llm

    return small_llm(tiny_pair[0], dtype="float32", block_size=4, max_model_len=256)
