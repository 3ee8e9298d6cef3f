"""A trainable, dense (no paged cache) EAGLE-3 head whose parameters are the published tensors one to one.

``TrainHead.state_dict()`` names are exactly the published layout's (``fc.weight``, ``midlayer.*`` with q/k/v and
gate/up unfused, ``norm.weight``, ``lm_head.weight``); ``d2t`` / ``t2d`` are buffers written beside them. There is
no ``embed_tokens``: the head embeds with the target's embedding, frozen (as SpecForge trains it and as published
heads ship). The forward of one draft step is the inference head's (``specdec/model/eagle3.py``), on ``[B, T]``
batches, with attention over the training-time-test cache (``ttt.py``).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from specdec.model.eagle3 import NUM_AUX_LAYERS, Eagle3Config
from specdec.model.llama import RMSNorm
from specdec.model.rope import RotaryEmbedding


class TrainAttention(nn.Module):
    """Attention over ``2 * H`` inputs whose step j query sees the step-0 keys causally plus the diagonal key of
    each later step (SpecForge's ``cache_hidden``): exactly what draft step j attends to at inference."""

    def __init__(self, config: Eagle3Config, rope: RotaryEmbedding):
        super().__init__()
        c = config.layer
        self.num_heads, self.num_kv_heads, self.head_dim = c.num_attention_heads, c.num_key_value_heads, c.head_dim
        h = c.hidden_size
        self.q_proj = nn.Linear(2 * h, self.num_heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(2 * h, self.num_kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(2 * h, self.num_kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, h, bias=False)
        self.rope = rope

    def forward(self, x: torch.Tensor, positions: torch.Tensor, cache: list[tuple[torch.Tensor, torch.Tensor]]
                ) -> torch.Tensor:
        b, t, _ = x.shape
        q = self.q_proj(x).view(b * t, self.num_heads, self.head_dim)  # (B*T, Hq, D)
        k = self.k_proj(x).view(b * t, self.num_kv_heads, self.head_dim)  # (B*T, Hkv, D)
        v = self.v_proj(x).view(b, t, self.num_kv_heads, self.head_dim).transpose(1, 2)  # (B, Hkv, T, D)
        q, k = self.rope(q, k, positions.reshape(-1))
        q = q.view(b, t, self.num_heads, self.head_dim).transpose(1, 2)  # (B, Hq, T, D)
        k = k.view(b, t, self.num_kv_heads, self.head_dim).transpose(1, 2)  # (B, Hkv, T, D)
        cache.append((k, v))
        group = self.num_heads // self.num_kv_heads
        k0, v0 = (z.repeat_interleave(group, dim=1) for z in cache[0])  # (B, Hq, T, D)
        scale = 1.0 / math.sqrt(self.head_dim)
        scores = (q @ k0.transpose(-1, -2)).float() * scale  # (B, Hq, T, T) over the context (step-0) keys
        causal = torch.ones(t, t, dtype=torch.bool, device=x.device).tril()
        scores = scores.masked_fill(~causal, float("-inf"))
        later = [(kj.repeat_interleave(group, dim=1), vj.repeat_interleave(group, dim=1)) for kj, vj in cache[1:]]
        if later:  # each later step: the key of the same row only (the draft entries of this chain)
            diag = torch.stack([(q * kj).sum(-1) for kj, _ in later], dim=-1).float() * scale  # (B, Hq, T, j)
            scores = torch.cat([scores, diag], dim=-1)  # (B, Hq, T, T + j)
        probs = scores.softmax(-1).to(q.dtype)
        out = probs[..., :t] @ v0  # (B, Hq, T, D)
        for i, (_, vj) in enumerate(later):
            out = out + probs[..., t + i, None] * vj
        return self.o_proj(out.transpose(1, 2).reshape(b, t, self.num_heads * self.head_dim))


class TrainMLP(nn.Module):
    def __init__(self, hidden: int, intermediate: int):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, intermediate, bias=False)
        self.up_proj = nn.Linear(hidden, intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class TrainLayer(nn.Module):
    """``midlayer``: attention over ``cat(input_layernorm(embed), hidden_norm(h))``, residual ``h``, llama MLP."""

    def __init__(self, config: Eagle3Config, rope: RotaryEmbedding):
        super().__init__()
        c = config.layer
        self.input_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.hidden_norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.self_attn = TrainAttention(config, rope)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.mlp = TrainMLP(c.hidden_size, c.intermediate_size)

    def forward(self, embeds, hidden, positions, cache) -> torch.Tensor:
        x = torch.cat([self.input_layernorm(embeds), self.hidden_norm(hidden)], dim=-1)  # (B, T, 2H)
        x = hidden + self.self_attn(x, positions, cache)
        return x + self.mlp(self.post_attention_layernorm(x))


class TrainHead(nn.Module):
    """The head being trained. ``fuse(aux)`` -> step-0 hidden; ``step(embeds, hidden, positions, cache)`` -> the
    step's pre-norm output ``[B, T, H]`` (fed to the next step); ``logits(x)`` -> ``[B, T, D]`` over the draft
    vocabulary."""

    def __init__(self, config: Eagle3Config, max_positions: int):
        super().__init__()
        assert not config.norm_before_residual, "the trainer writes heads with norm_before_residual false"
        c = config.layer
        self.config = config
        self.rope = RotaryEmbedding(c, max_positions)  # non-persistent tables: not in the state dict
        self.fc = nn.Linear(NUM_AUX_LAYERS * config.target_hidden_size, c.hidden_size, bias=False)
        self.midlayer = TrainLayer(config, self.rope)
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.lm_head = nn.Linear(c.hidden_size, config.draft_vocab_size, bias=False)

    def fuse(self, aux: torch.Tensor) -> torch.Tensor:
        """``[B, T, 3 * H_target]`` -> ``[B, T, H]``."""
        return self.fc(aux)

    def step(self, embeds, hidden, positions, cache) -> torch.Tensor:
        return self.midlayer(embeds, hidden, positions, cache)

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.norm(x))

    def published_state(self) -> dict[str, torch.Tensor]:
        """The head's tensors under their published names (fp32 copies on the CPU; no ``d2t`` / ``t2d``)."""
        return {name: t.detach().float().cpu().contiguous() for name, t in self.state_dict().items()}


def load_train_head(path: str, max_positions: int) -> tuple[TrainHead, torch.Tensor, torch.Tensor | None]:
    """A head in the published layout (folder ``path``: ours, or one trained elsewhere) as a :class:`TrainHead`
    (fp32, CPU), with its ``d2t`` int64 ``[D]`` (zeros when the file has none) and ``t2d`` (None when absent).
    ``ValueError`` if the folder is not such a head, or has its own ``embed_tokens`` or ``norm_before_residual``
    (not trained here)."""
    from specdec.checkpoint.eagle3 import check_layout, iter_head_weights, read_head_tensors

    config = Eagle3Config.from_json(path)
    tensors = read_head_tensors(iter_head_weights(path))
    check_layout(tensors, config, f"the EAGLE-3 head at {path}")
    if "embed_tokens.weight" in tensors or config.norm_before_residual:
        raise ValueError(f"the EAGLE-3 head at {path} has its own embed_tokens or norm_before_residual: the trainer "
                         "trains heads that share the target's embedding, with norm_before_residual false")
    head = TrainHead(config, max_positions)
    head.load_state_dict({k: v.float() for k, v in tensors.items() if k not in ("d2t", "t2d")})
    d2t = tensors["d2t"].long() if "d2t" in tensors else torch.zeros(config.draft_vocab_size, dtype=torch.int64)
    return head, d2t, tensors.get("t2d")
