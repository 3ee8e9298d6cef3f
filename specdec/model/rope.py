"""Rotary position embeddings (HF ``rotate_half`` convention), with Llama-3 frequency scaling."""

from __future__ import annotations

import math

import torch

from specdec.kernels.rope_kv import apply_rope_reference
from specdec.model.config import ModelConfig, RopeScaling


def inverse_frequencies(head_dim: int, theta: float, scaling: RopeScaling | None) -> torch.Tensor:
    """fp32 ``[head_dim // 2]`` inverse frequencies, Llama-3 scaled when ``scaling`` is given."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
    if scaling is not None:
        inv_freq = _llama3_scale(inv_freq, scaling)
    return inv_freq.float()


def _llama3_scale(inv_freq: torch.Tensor, s: RopeScaling) -> torch.Tensor:
    """Llama-3.1 rope scaling: long wavelengths divided by ``factor``, short kept, a smooth blend between."""
    low_freq_wavelen = s.original_max_position_embeddings / s.low_freq_factor
    high_freq_wavelen = s.original_max_position_embeddings / s.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / s.factor, inv_freq)
    smooth = (s.original_max_position_embeddings / wavelen - s.low_freq_factor) / (
        s.high_freq_factor - s.low_freq_factor
    )
    blended = (1 - smooth) * scaled / s.factor + smooth * scaled
    is_medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return torch.where(is_medium, blended, scaled)


class RotaryEmbedding(torch.nn.Module):
    """Precomputed cos/sin tables indexed by absolute position."""

    def __init__(self, config: ModelConfig, max_positions: int):
        super().__init__()
        self.config = config
        self.max_positions = max_positions
        self.register_buffer("cos", torch.empty(max_positions, config.head_dim), persistent=False)
        self.register_buffer("sin", torch.empty(max_positions, config.head_dim), persistent=False)
        if self.cos.device.type != "meta":
            self.reset(self.cos.device)

    def reset(self, device: torch.device | str) -> None:
        """(Re)compute the fp32 cos/sin tables ``[max_positions, D]`` on ``device``."""
        c = self.config
        inv_freq = inverse_frequencies(c.head_dim, c.rope_theta, c.rope_scaling)
        t = torch.arange(self.max_positions, dtype=torch.float32)
        freqs = torch.outer(t, inv_freq)  # (P, D/2)
        emb = torch.cat([freqs, freqs], dim=-1)  # (P, D)
        self.cos = emb.cos().to(device)
        self.sin = emb.sin().to(device)

    def forward(self, q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Rotate ``q [T, Hq, D]`` and ``k [T, Hkv, D]`` by ``positions [T]`` (int64)."""
        return apply_rope_reference(q, k, self.cos, self.sin, positions)
