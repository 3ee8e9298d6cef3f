"""Temperature softmax: the Triton kernel against its torch reference, and the reference against hand values.

CPU tensors run the kernel in the Triton interpreter (tests/conftest.py sets TRITON_INTERPRET=1); on a machine
with CUDA the same tests also run the compiled kernel.
"""

import math
import os

import pytest
import torch

from specdec.kernels.softmax import (
    MAX_VOCAB,
    softmax_config,
    softmax_with_temperature,
    softmax_with_temperature_reference,
)

DEVICES = [
    pytest.param(
        "cpu", marks=pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="needs TRITON_INTERPRET=1")
    ),
    pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")),
]
# The math is fp32 after an exact upcast, so every input dtype gets an fp32-sized tolerance; the compiled
# kernel uses the GPU's approximate exp / division, hence the looser CUDA one.
TOL = {
    ("cpu", torch.float32): {"rtol": 1e-5, "atol": 1e-9},
    ("cpu", torch.float16): {"rtol": 1e-5, "atol": 1e-9},
    ("cpu", torch.bfloat16): {"rtol": 1e-5, "atol": 1e-9},
    ("cuda", torch.float32): {"rtol": 1e-4, "atol": 1e-8},
    ("cuda", torch.float16): {"rtol": 1e-4, "atol": 1e-8},
    ("cuda", torch.bfloat16): {"rtol": 1e-4, "atol": 1e-8},
}


def _check_against_reference(logits: torch.Tensor, temperature: torch.Tensor, device: str) -> None:
    probs, bad_row = softmax_with_temperature(logits.to(device), temperature.to(device))
    ref_probs, ref_bad = softmax_with_temperature_reference(logits, temperature)
    assert probs.dtype == torch.float32 and probs.shape == logits.shape and probs.is_contiguous()
    assert bad_row.dtype == torch.bool
    torch.testing.assert_close(bad_row.cpu(), ref_bad)
    good = ~ref_bad
    torch.testing.assert_close(probs.cpu()[good], ref_probs[good], **TOL[(device, logits.dtype)])
    torch.testing.assert_close(probs.cpu()[good].sum(-1), torch.ones(int(good.sum())), rtol=0, atol=1e-5)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("vocab", [111, 1000, 4099])
def test_matches_reference(vocab: int, dtype: torch.dtype, device: str) -> None:
    g = torch.Generator().manual_seed(vocab)
    # Row stride 4133 != vocab: the kernel must honour the row stride of a non-contiguous view.
    logits = (torch.randn(5, 4133, generator=g) * 4).to(dtype)[:, :vocab]
    temperature = torch.tensor([0.0, 0.5, 1.0, 2.0, 1.3])  # row 0 is greedy: computed at t = 1
    _check_against_reference(logits, temperature, device)


@pytest.mark.parametrize("device", DEVICES)
def test_hand_values(device: str) -> None:
    # softmax([0, ln 3]) = [1/4, 3/4]; at t = 1/2 the logits double: [1, 9] / 10. Temperature 0 computes at 1.
    logits = torch.tensor([[0.0, math.log(3.0)]] * 3)
    temperature = torch.tensor([1.0, 0.5, 0.0])
    expected = torch.tensor([[0.25, 0.75], [0.1, 0.9], [0.25, 0.75]])
    for fn in (softmax_with_temperature_reference, softmax_with_temperature):
        probs, bad_row = fn(logits.to(device), temperature.to(device))
        torch.testing.assert_close(probs.cpu(), expected, rtol=1e-6, atol=1e-7)
        assert not bad_row.any()


@pytest.mark.parametrize("device", DEVICES)
def test_online_max_across_chunks(device: str) -> None:
    # Large logits whose max sits in the first, the middle or the last chunk of a 3-chunk row: the running sum
    # must be rescaled when a later chunk raises the max (exp(1e4) overflows without the max subtraction).
    vocab = softmax_config(4099).block * 2 + 3
    logits = torch.full((4, vocab), 9000.0)
    logits[0, 0] = 10000.0
    logits[1, vocab // 2] = 10000.0
    logits[2, -1] = 10000.0
    logits[3] = torch.linspace(-10000.0, 10000.0, vocab)
    _check_against_reference(logits, torch.tensor([1.0, 100.0, 1000.0, 3000.0]), device)


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # numpy (interpreter) warns on the NaN arithmetic
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_non_finite_rows_flagged(dtype: torch.dtype, device: str) -> None:
    vocab = 4099
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(7, vocab, generator=g).to(dtype)
    logits[1, 0] = float("nan")
    logits[2, vocab - 1] = float("inf")  # last lane of the last (partial) chunk
    logits[3, 2048] = float("-inf")  # -inf too: the contract flags any non-finite value
    logits[5, :] = float("nan")
    temperature = torch.tensor([1.0, 1.0, 0.0, 2.0, 0.7, 1.0, 1.0])
    _, bad_row = softmax_with_temperature(logits.to(device), temperature.to(device))
    assert bad_row.cpu().tolist() == [False, True, True, True, False, True, False]
    _check_against_reference(logits, temperature, device)  # good rows are unaffected by their neighbours


@pytest.mark.parametrize("device", DEVICES)
def test_single_token_and_empty_batch(device: str) -> None:
    probs, bad_row = softmax_with_temperature(
        torch.tensor([[3.0], [-2.0]], device=device), torch.ones(2, device=device)
    )
    assert probs.cpu().tolist() == [[1.0], [1.0]] and not bad_row.any()
    probs, bad_row = softmax_with_temperature(torch.zeros(0, 7, device=device), torch.ones(0, device=device))
    assert probs.shape == (0, 7) and bad_row.shape == (0,)


def test_config_and_validation() -> None:
    assert softmax_config(111).block == 128
    assert softmax_config(151936).block == 4096
    with pytest.raises(ValueError, match="vocab"):
        softmax_config(MAX_VOCAB + 1)
    logits, temperature = torch.zeros(2, 8), torch.ones(2)
    with pytest.raises(ValueError, match="fp32/fp16/bf16"):
        softmax_with_temperature(logits.double(), temperature)
    with pytest.raises(ValueError, match="temperature"):
        softmax_with_temperature(logits, torch.ones(3))
    with pytest.raises(ValueError, match="temperature"):
        softmax_with_temperature(logits, temperature.half())
    with pytest.raises(ValueError, match="column stride"):
        softmax_with_temperature(torch.zeros(8, 2).t(), temperature)
    with pytest.raises(ValueError, match=r"\[R, V\]"):
        softmax_with_temperature(torch.zeros(8), temperature)


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # numpy (interpreter) warns on the NaN arithmetic
@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="needs TRITON_INTERPRET=1")
def test_ops_dispatch_reaches_the_kernel() -> None:
    from specdec import ops

    logits, temperature = torch.tensor([[0.0, math.log(3.0)], [float("nan"), 0.0]]), torch.ones(2)
    with ops.force_triton():
        probs, bad_row = ops.softmax_with_temperature(logits, temperature)
    assert bad_row.tolist() == [False, True]
    torch.testing.assert_close(probs[0], torch.tensor([0.25, 0.75]))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_reference_is_torch_softmax_bit_for_bit(dtype) -> None:
    """The CPU reference softmaxes in place (``aten._softmax.out`` onto its own quotient tensor) and finds bad rows
    from a row max and min: the same bits as ``torch.softmax(x / t)`` and the same flags as an elementwise
    isfinite, and the caller's logits are never written."""
    gen = torch.Generator().manual_seed(3)
    logits = (4 * torch.randn(9, 5003, generator=gen)).to(dtype)
    logits[1, 7] = float("nan")
    logits[2, 0] = float("inf")
    logits[3, -1] = -float("inf")
    before = logits.clone()
    temperature = torch.tensor([0.0, 1.0, 0.7, 1.3, 0.05, 2.0, 1.0, 0.9, 1e-3])
    probs, bad_row = softmax_with_temperature_reference(logits, temperature)
    x = logits.float()
    t = torch.where(temperature > 0, temperature, torch.ones_like(temperature))
    assert torch.equal(bad_row, ~torch.isfinite(x).all(dim=-1))
    good = ~bad_row
    assert torch.equal(probs[good], torch.softmax(x / t[:, None], dim=-1)[good])
    torch.testing.assert_close(logits, before, rtol=0, atol=0, equal_nan=True)
