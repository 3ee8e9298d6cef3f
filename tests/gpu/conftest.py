"""tests/gpu: selected with ``-m gpu``; on a machine without CUDA every test FAILS ("needs CUDA"), never passes or
skips. A module whose tests can also run on CPU (a self-check pointing its DEVICE elsewhere) overrides
``_needs_cuda`` with its own."""

import pytest
import torch


@pytest.fixture
def no_tf32():
    """fp32 matmuls in fp32 (no TF32) for the test, as the torch references compute them; restored after."""
    before = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32 = before


@pytest.fixture(autouse=True)
def _needs_cuda(request):
    if not torch.cuda.is_available():
        pytest.fail(f"needs CUDA: {request.node.nodeid} runs on a GPU (tests/gpu; run them on a CUDA machine)")
