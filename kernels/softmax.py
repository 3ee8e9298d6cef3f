"""Row softmax with a per-row temperature, fp32 out, and a per-row flag for non-finite input."""

import torch


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
    bad_row = ~torch.isfinite(x).all(dim=-1)
    t = torch.where(temperature > 0, temperature, torch.ones_like(temperature)).float()
    probs = torch.softmax(x / t[:, None], dim=-1)
    return probs, bad_row
