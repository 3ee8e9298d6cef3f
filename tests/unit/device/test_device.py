"""specdec.device.to_device on CPU: the same tensors torch.tensor / torch.from_numpy give (its CUDA side, the
non-blocking pinned copy, is tests/gpu/test_device_cuda.py)."""

import numpy as np
import torch

from specdec.device import to_device


def test_lists_are_copied_with_the_asked_dtype():
    out = to_device([[1, 2], [3, 4]], torch.int32, "cpu")
    assert out.dtype == torch.int32 and out.tolist() == [[1, 2], [3, 4]]
    assert to_device([True, False], torch.bool, torch.device("cpu")).tolist() == [True, False]
    assert to_device([], torch.int64, "cpu").shape == (0,)


def test_numpy_is_shared_on_cpu_and_converted_when_the_dtype_differs():
    a = np.arange(6, dtype=np.int64)
    shared = to_device(a, torch.int64, "cpu")
    a[0] = 42
    assert shared[0].item() == 42  # torch.from_numpy: no copy, as before
    f = to_device(np.array([0.5, 1.5], dtype=np.float32), torch.float32, "cpu")
    assert f.dtype == torch.float32 and f.tolist() == [0.5, 1.5]
    assert to_device(np.array([1, 2], dtype=np.int64), torch.int32, "cpu").dtype == torch.int32


def test_tensors_keep_their_values():
    t = torch.tensor([3, 1, 2])
    assert torch.equal(to_device(t, torch.int64, "cpu"), t)
