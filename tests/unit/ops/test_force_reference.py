"""``ops.force_reference()``, the switch tests/gpu relies on to compare a kernel with its reference on the same
device: checked here on CPU (default suite), where forcing Triton runs the interpreter."""

import torch

from specdec import ops
from specdec.kernels.softmax import softmax_with_temperature_reference


def test_switches_nest_and_the_innermost_wins():
    x = torch.zeros(1)
    assert not ops.use_triton(x)
    with ops.force_triton():
        assert ops.use_triton(x)
        with ops.force_reference():
            assert not ops.use_triton(x)
            with ops.force_triton():
                assert ops.use_triton(x)
            with ops.force_reference(False):  # back to dispatch by device
                assert not ops.use_triton(x)
        assert ops.use_triton(x)
    assert not ops.use_triton(x)


def test_force_reference_overrides_force_triton_in_an_op(monkeypatch):
    def kernel_called(*args):
        raise AssertionError("the Triton launcher ran inside force_reference()")

    monkeypatch.setattr(ops._softmax, "softmax_with_temperature", kernel_called)
    logits, temperature = torch.randn(2, 7), torch.tensor([1.0, 0.5])
    with ops.force_triton(), ops.force_reference():
        probs, bad = ops.softmax_with_temperature(logits, temperature)
    ref, ref_bad = softmax_with_temperature_reference(logits, temperature)
    assert torch.equal(probs, ref) and torch.equal(bad, ref_bad)
