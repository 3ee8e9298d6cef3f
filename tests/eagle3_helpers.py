"""The tiny EAGLE-3 setup shared by tests/engine/test_eagle3.py, tests/tp/test_tp_eagle3.py and
tests/unit/training/test_train_draft.py: its sizes, prompts, the pools check, and ``ReferenceHead`` - EAGLE-3
written out densely from the published description (no paged cache, no code shared with specdec)."""

from __future__ import annotations

import json
import os

import torch
from safetensors.torch import load_file

VOCAB, HIDDEN, LAYERS = 300, 64, 4
HEAD_HEADS, HEAD_MLP = 4, 96
DRAFT_IDS = sorted(set(range(0, VOCAB, 3)) | set(range(250, VOCAB)))  # a draft vocabulary with gaps and the top ids


def prompts(n, seed=0, lo=3, hi=40):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 257, (int(torch.randint(lo, hi, (1,), generator=gen)),), generator=gen).tolist()
            for _ in range(n)]


def assert_pools_whole(llm):
    pools = list(llm.engine.block_managers)
    assert len(pools) == 2  # the target's and the head's
    for bm in pools:
        bm.check_invariants()
        assert bm.num_free_blocks == bm.num_blocks


def hidden_states_before_norm(hf, ids: list[int]) -> list[torch.Tensor]:
    """transformers' ``hidden_states`` of ``ids`` ([T, H] each), the last one taken before the final norm."""
    captured = {}

    def hook(module, args, output):
        captured["last"] = output[0] if isinstance(output, tuple) else output

    handle = hf.model.layers[-1].register_forward_hook(hook)
    try:
        with torch.no_grad():
            states = hf(torch.tensor([ids]), output_hidden_states=True).hidden_states
    finally:
        handle.remove()
    return [s[0] for s in states[:-1]] + [captured["last"][0]]


# --- the dense reference -----------------------------------------------------------------------------------------
class ReferenceHead:
    """EAGLE-3 written out densely from the published description (no paged cache, no code shared with specdec):
    entry p = (embedding of token p + 1, fc(target hidden states at p)) at rotary position p; a drafted entry is fed
    the previous entry's output hidden state."""

    def __init__(self, head_dir: str, target_dir: str):
        import transformers

        self.hf = transformers.LlamaForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()
        with open(os.path.join(head_dir, "config.json")) as f:
            self.cfg = json.load(f)
        raw = load_file(os.path.join(head_dir, "model.safetensors"))
        self.w = {k.replace("layers.0.", "midlayer."): v.float() if v.is_floating_point() else v
                  for k, v in raw.items()}
        self.embed = self.w.get("embed_tokens.weight", self.hf.model.embed_tokens.weight.detach())
        self.target_ids = torch.arange(self.w["lm_head.weight"].shape[0]) + self.w["d2t"]
        ids = self.cfg.get("eagle_config", {}).get("eagle_aux_hidden_state_layer_ids")
        n = self.hf.config.num_hidden_layers
        self.layers = ids if ids is not None else [2, n // 2, n - 3]

    def target_hidden(self, tokens: list[int]) -> torch.Tensor:
        states = hidden_states_before_norm(self.hf, tokens)
        return torch.cat([states[k] for k in self.layers], dim=-1)  # [T, 3H]

    def _rms(self, x, name):
        eps = self.cfg["rms_norm_eps"]
        return self.w[name] * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))

    def run(self, tokens: list[int], hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Dense causal forward of entries (token, hidden) at positions 0..T-1: (q over the target vocabulary at
        temperature 1 [T, V], output hidden states [T, H])."""
        w, cfg = self.w, self.cfg
        heads, kv_heads, dim = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]
        t = len(tokens)
        if cfg.get("norm_before_residual"):
            hidden = self._rms(hidden, "midlayer.hidden_norm.weight")
            residual, normed = hidden, hidden
        else:
            residual, normed = hidden, self._rms(hidden, "midlayer.hidden_norm.weight")
        x = torch.cat([self._rms(self.embed[tokens], "midlayer.input_layernorm.weight"), normed], dim=-1)
        q = (x @ w["midlayer.self_attn.q_proj.weight"].T).view(t, heads, dim)
        k = (x @ w["midlayer.self_attn.k_proj.weight"].T).view(t, kv_heads, dim)
        v = (x @ w["midlayer.self_attn.v_proj.weight"].T).view(t, kv_heads, dim)
        inv = 1.0 / (cfg["rope_theta"] ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))
        angles = torch.arange(t, dtype=torch.float64)[:, None] * inv[None]
        cos, sin = torch.cat([angles, angles], -1).cos()[:, None].float(), torch.cat([angles, angles], -1).sin()[
            :, None].float()

        def rotate(a):
            return a * cos + torch.cat([-a[..., dim // 2 :], a[..., : dim // 2]], -1) * sin

        q, k = rotate(q), rotate(k)
        k = k.repeat_interleave(heads // kv_heads, dim=1)
        v = v.repeat_interleave(heads // kv_heads, dim=1)
        scores = torch.einsum("qhd,khd->hqk", q, k) / dim**0.5
        scores = scores.masked_fill(torch.ones(t, t, dtype=torch.bool).triu(1), float("-inf"))
        attn = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v).reshape(t, heads * dim)
        x = residual + attn @ w["midlayer.self_attn.o_proj.weight"].T
        n = self._rms(x, "midlayer.post_attention_layernorm.weight")
        gate, up = n @ w["midlayer.mlp.gate_proj.weight"].T, n @ w["midlayer.mlp.up_proj.weight"].T
        x = x + (torch.nn.functional.silu(gate) * up) @ w["midlayer.mlp.down_proj.weight"].T
        logits = self._rms(x, "norm.weight") @ w["lm_head.weight"].T
        q_target = torch.zeros(t, self.hf.config.vocab_size)
        q_target[:, self.target_ids] = logits.softmax(-1)
        return q_target, x

    def path_q(self, context: list[int], path: list[int]) -> torch.Tensor:
        """q after ``context`` (the request's tokens when it drafts) and the drafted ``path``: entries 0..n-2 from
        the target's hidden states, then one per drafted token, each fed the entry before's output."""
        fused = self.target_hidden(context[:-1]) @ self.w["fc.weight"].T  # entries 0..n-2
        tokens, hidden = list(context[1:]), fused
        q, out = self.run(tokens, hidden)
        for token in path:
            tokens.append(token)
            hidden = torch.cat([hidden, out[-1:]])
            q, out = self.run(tokens, hidden)
        return q[-1]
