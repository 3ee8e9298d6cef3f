"""specdec.device.to_device on CUDA: values arrive, and the copy does not synchronise the stream (the point of it).
Marked gpu; selected without CUDA every test FAILS ("needs CUDA")."""

import numpy as np
import pytest
import torch

from specdec.device import to_device

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("data", [[1, 2, 3], np.arange(5), torch.arange(4)], ids=["list", "numpy", "tensor"])
def test_no_sync_and_same_values(data):
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")  # a synchronising copy raises
    try:
        out = to_device(data, torch.int64, "cuda")
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
    assert out.is_cuda and out.cpu().tolist() == list(np.asarray(data).tolist())
