"""Row softmax with a per-row temperature, fp32 out, and a per-row flag for non-finite input.

Kernel design: one program per row. The row is read in ``BLOCK``-wide chunks twice - pass 1 keeps an online
(running) max and sum of exponentials and a count of finite values per lane (vectors of ``BLOCK``), reduced
across lanes once after the loop, pass 2 writes ``exp(x / t - max) / sum``.
All math is fp32 whatever the input dtype; row offsets are int64.
"""

from typing import NamedTuple

import torch

from specdec.kernels._triton import tl, triton

# NOTE: one program owns a whole row, so very long rows would leave the GPU idle for a long time; the largest
# vocabularies we target (Llama-3 128256, Qwen2.5 151936, Gemma 256000) are far below this bound.
MAX_VOCAB = 1 << 20
_MAX_BLOCK = 4096  # fp32 elements per chunk: 16 per thread at 8 warps


class RowConfig(NamedTuple):
    """Launch settings of a row-wise kernel."""

    block: int  # elements per chunk of the row loop (power of two)
    num_warps: int


def softmax_config(vocab: int) -> RowConfig:
    """Fixed block size / warp count for rows of ``vocab`` elements; raises ``ValueError`` on rows too long."""
    if not 1 <= vocab <= MAX_VOCAB:
        raise ValueError(f"softmax_with_temperature supports 1 <= vocab <= {MAX_VOCAB}, got {vocab}")
    block = min(triton.next_power_of_2(vocab), _MAX_BLOCK)
    return RowConfig(block=block, num_warps=4 if block < 2048 else 8)


@triton.jit
def _softmax_temperature_kernel(
    logits_ptr,  # [R, V] fp32/fp16/bf16, unit column stride
    temperature_ptr,  # fp32 [R]
    probs_ptr,  # fp32 [R, V], unit column stride
    bad_row_ptr,  # bool [R]
    vocab,
    logits_row_stride,
    probs_row_stride,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    logits_row = logits_ptr + row * logits_row_stride
    probs_row = probs_ptr + row * probs_row_stride
    cols = tl.arange(0, BLOCK)

    t = tl.load(temperature_ptr + row)
    # Greedy rows (t == 0) are computed at t = 1, like the reference (`t > 0` is also False for NaN / negatives).
    t = tl.where(t > 0, t, 1.0)

    # Pass 1: per-lane running max m and sum s of exp(x / t - m), and per-lane counts of finite values; one
    # block-wide reduction of each after the loop (not one per chunk: a reduction is a barrier and a shuffle tree).
    m_lane = tl.full([BLOCK], float("-inf"), tl.float32)
    s_lane = tl.zeros([BLOCK], tl.float32)
    finite_lane = tl.zeros([BLOCK], tl.int32)
    for start in range(0, vocab, BLOCK):
        offs = start + cols
        mask = offs < vocab
        # NOTE: upcast right after the load (bf16 arithmetic is wrong in the interpreter); masked lanes are -inf
        # so they add exp(-inf) = 0.
        x = tl.load(logits_row + offs, mask=mask, other=float("-inf")).to(tl.float32)
        finite_lane += (tl.abs(x) < float("inf")).to(tl.int32)  # False for NaN, +-inf, masked
        y = x / t
        m_new = tl.maximum(m_lane, y)
        # NOTE: a lane that has seen only -inf (masked lanes of a row shorter than BLOCK) keeps m = -inf; shift by
        # 0 there so that it adds exp(-inf) = 0 instead of exp(-inf - -inf) = NaN.
        m_shift = tl.where(m_new == float("-inf"), 0.0, m_new)
        s_lane = s_lane * tl.exp(m_lane - m_shift) + tl.exp(y - m_shift)
        m_lane = m_new
    m = tl.max(m_lane, axis=0)  # finite in a good row; lanes at -inf add 0 * exp(-inf) = 0 below
    s = tl.sum(s_lane * tl.exp(m_lane - m), axis=0)
    num_finite = tl.sum(finite_lane, axis=0)

    # Pass 2: normalised probabilities. Bad rows (a value is not finite) hold garbage here; the caller raises.
    inv_s = 1.0 / s
    for start in range(0, vocab, BLOCK):
        offs = start + cols
        mask = offs < vocab
        x = tl.load(logits_row + offs, mask=mask, other=float("-inf")).to(tl.float32)
        tl.store(probs_row + offs, tl.exp(x / t - m) * inv_s, mask=mask)
    tl.store(bad_row_ptr + row, num_finite < vocab)


def softmax_with_temperature(logits: torch.Tensor, temperature: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton temperature softmax; same contract as :func:`softmax_with_temperature_reference`.

    Args:
        logits: ``[R, V]`` fp32/fp16/bf16 with unit column stride (any row stride), ``V <= MAX_VOCAB``.
        temperature: fp32 ``[R]`` on the same device; ``<= 0`` (greedy) is computed as 1.
    Returns:
        probs: fp32 ``[R, V]`` contiguous; rows flagged in ``bad_row`` are unspecified (NaN in practice).
        bad_row: bool ``[R]``, True where the row holds NaN or +-inf.
    """
    if logits.ndim != 2:
        raise ValueError(f"logits must be [R, V], got shape {tuple(logits.shape)}")
    if logits.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        raise ValueError(f"logits must be fp32/fp16/bf16, got {logits.dtype}")
    rows, vocab = logits.shape
    if temperature.shape != (rows,) or temperature.dtype != torch.float32:
        raise ValueError(f"temperature must be fp32 [{rows}], got {temperature.dtype} {tuple(temperature.shape)}")
    if temperature.device != logits.device:
        raise ValueError(f"temperature is on {temperature.device}, logits on {logits.device}")
    if vocab > 1 and logits.stride(1) != 1:
        raise ValueError("logits must have unit column stride (call .contiguous())")
    block, num_warps = softmax_config(vocab)

    probs = torch.empty((rows, vocab), dtype=torch.float32, device=logits.device)
    bad_row = torch.empty((rows,), dtype=torch.bool, device=logits.device)
    if rows == 0:
        return probs, bad_row
    _softmax_temperature_kernel[(rows,)](
        logits,
        temperature.contiguous(),
        probs,
        bad_row,
        vocab,
        logits.stride(0),
        probs.stride(0),
        BLOCK=block,
        num_warps=num_warps,
    )
    return probs, bad_row


def softmax_with_temperature_reference(
    logits: torch.Tensor, temperature: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Torch reference (and CPU path) of the temperature softmax.

    Args:
        logits: ``[R, V]`` fp32/fp16/bf16 (penalties already applied).
        temperature: fp32 ``[R]``; rows with temperature 0 (greedy) are computed with temperature 1 - the
            caller takes the argmax of the raw logits for those rows and never samples from these probs.
    Returns:
        probs: fp32 ``[R, V]`` = softmax(logits / temperature).
        bad_row: bool ``[R]``, True where the row holds NaN or +-inf (its probs are unusable; raise).
    """
    x = logits.float()
    # NaN / inf rows from a row max and min (a NaN propagates through both): two vectorised reductions instead of
    # an elementwise isfinite over [R, V] and its all()
    bad_row = ~(torch.isfinite(x.amax(dim=-1)) & torch.isfinite(x.amin(dim=-1)))
    t = torch.where(temperature > 0, temperature, torch.ones_like(temperature)).float()
    probs = torch.div(x, t[:, None])  # a new tensor: logits are never written
    if probs.is_cuda:  # the reference on a GPU (tests comparing it with the kernel)
        return torch.softmax(probs, dim=-1), bad_row
    # On CPU, in place: the same bits as torch.softmax (tests/kernels/test_softmax.py) without a second [R, V]
    # tensor - at 64 x 128256 a fresh one costs more in page faults than the softmax itself.
    torch.ops.aten._softmax.out(probs, -1, False, out=probs)
    return probs, bad_row
