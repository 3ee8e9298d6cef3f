"""EAGLE-3 draft heads: the config and the head's forward on a paged cache. The published checkpoint layout, its
validation and loading are specdec/checkpoint/eagle3.py.

The head's forward (as vLLM's and SpecForge's): ``residual = h``, ``x = cat(input_layernorm(embed(token)),
hidden_norm(h))`` (with ``norm_before_residual`` the residual is the normed ``h``), ``x = residual + attn(x)``,
``x = x + mlp(post_attention_layernorm(x))``; logits ``lm_head(norm(x))`` over the draft vocabulary, and ``x``
(before the final norm) is the hidden state the next draft step is fed. ``h`` is ``fc(target's three hidden
states)`` for a context position and the head's own ``x`` for a drafted one.

Which target layers: ``eagle_aux_hidden_state_layer_ids`` as vLLM reads them - id k is the hidden state entering
decoder layer k (transformers' ``hidden_states[k]``: 0 the embeddings, k >= 1 the output of layer k - 1; id L, the
last layer's output, is taken before the final norm, where transformers' ``hidden_states[L]`` is after it) - and,
without one, vLLM's default ``(2, L // 2, L - 3)`` (the same states as SpecForge's default, which counts layer
outputs: ``(1, L // 2 - 1, L - 4)``). SGLang adds one to configured ids (since sglang#25454 only when the first id
is 1); a head trained for SGLang with explicit ids may need them shifted.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass

import torch
from torch import nn

from specdec.model.config import ModelConfig
from specdec.model.linear import Linear
from specdec.model.llama import MLP, Attention, AttentionMetadata, RMSNorm
from specdec.model.rope import RotaryEmbedding

EAGLE3_ARCHITECTURES = ("LlamaForCausalLMEagle3", "Eagle3LlamaForCausalLM")
NUM_AUX_LAYERS = 3  # EAGLE-3 fuses three target hidden states (low, mid, high): fc takes 3 * H_target
# A target id outside the draft vocabulary gets this logit when the head's logits are laid out over the target's
# vocabulary: finite (the NaN/inf guards of the samplers look at raw logits), and so low that its probability is
# exactly 0 after any temperature, penalty or filter (exp underflows), and it is never an argmax.
OUTSIDE_DRAFT_VOCAB = -1e30


def default_aux_layers(num_target_layers: int) -> tuple[int, ...]:
    """vLLM's default EAGLE-3 layers for a target of ``num_target_layers`` layers: ``(2, L // 2, L - 3)`` (ids
    count the hidden state entering a layer: see the module docstring)."""
    n = num_target_layers
    return (2, n // 2, n - 3)


@dataclass(frozen=True)
class Eagle3Config:
    """An EAGLE-3 head's ``config.json``: ``layer`` holds the decoder layer's shapes, rope and norms (and
    ``vocab_size``, the target's vocabulary); the rest is EAGLE-3's own."""

    layer: ModelConfig
    draft_vocab_size: int
    target_hidden_size: int
    aux_layer_ids: tuple[int, ...] | None = None  # as the config names them; None: the default for the target
    norm_before_residual: bool = False

    @classmethod
    def from_json(cls, path: str) -> Eagle3Config:
        """Read ``config.json`` at ``path`` (a file, or a directory holding one); ``ValueError`` if it is not an
        EAGLE-3 head in the published layout, naming what is missing or not supported."""
        file = os.path.join(path, "config.json") if os.path.isdir(path) else path
        if not os.path.isfile(file):
            raise ValueError(f"no config.json at {path}")
        with open(file, encoding="utf-8") as f:
            try:
                raw = json.load(f)
            except json.JSONDecodeError as e:
                raise ValueError(f"config.json at {file} is not valid JSON: {e}") from e
        return cls.from_dict(raw, source=file)

    @classmethod
    def from_dict(cls, raw: dict, source: str = "the EAGLE-3 config") -> Eagle3Config:
        archs = raw.get("architectures") or []
        if not any(a in EAGLE3_ARCHITECTURES for a in archs):
            if "Eagle3Speculator" in archs or "speculators_config" in raw:
                raise ValueError(f"{source}: speculators' own config layout (Eagle3Speculator, "
                                 "transformer_layer_config) is not read yet; a head needs architectures "
                                 f"{list(EAGLE3_ARCHITECTURES[:1])} with the llama keys at the top level")
            raise ValueError(f"{source} is not an EAGLE-3 head: its architectures are {archs}, expected one of "
                             f"{list(EAGLE3_ARCHITECTURES)} (a standalone draft model is method='draft_model')")
        if raw.get("num_hidden_layers") != 1:
            raise ValueError(f"{source}: an EAGLE-3 head has one decoder layer (num_hidden_layers: 1), got "
                             f"{raw.get('num_hidden_layers')!r}")
        eagle = raw.get("eagle_config") or {}
        if not isinstance(eagle, dict):
            raise ValueError(f"{source}: eagle_config must be an object, got {eagle!r}")
        if eagle.get("use_aux_hidden_state", True) is False:
            raise ValueError(f"{source}: eagle_config.use_aux_hidden_state is false (an EAGLE-1 style head fed one "
                             "hidden state); only EAGLE-3 heads, fed three fused target layers, are supported")
        for key in ("norm_before_fc", "use_input_layernorm_in_first_layer"):
            if raw.get(key) or eagle.get(key):
                raise ValueError(f"{source}: {key} is set; this variant of the EAGLE-3 layout is not supported")
        ids = raw.get("eagle_aux_hidden_state_layer_ids", eagle.get("eagle_aux_hidden_state_layer_ids"))
        if ids is not None:
            if (not isinstance(ids, list) or len(ids) != NUM_AUX_LAYERS
                    or any(not isinstance(i, int) or isinstance(i, bool) or i < 0 for i in ids)):
                raise ValueError(f"{source}: eagle_aux_hidden_state_layer_ids must list {NUM_AUX_LAYERS} layer ids "
                                 f">= 0, got {ids!r}")
            ids = tuple(ids)
        layer = ModelConfig.from_dict(raw)
        draft_vocab = raw.get("draft_vocab_size") or layer.vocab_size
        if not isinstance(draft_vocab, int) or not 1 <= draft_vocab <= layer.vocab_size:
            raise ValueError(f"{source}: draft_vocab_size must be an integer in [1, vocab_size={layer.vocab_size}], "
                             f"got {draft_vocab!r}")
        target_hidden = raw.get("target_hidden_size") or layer.hidden_size
        if not isinstance(target_hidden, int) or target_hidden < 1:
            raise ValueError(f"{source}: target_hidden_size must be a positive integer, got {target_hidden!r}")
        norm_before_residual = raw.get("norm_before_residual", False)
        if not isinstance(norm_before_residual, bool):
            raise ValueError(f"{source}: norm_before_residual must be true or false, got {norm_before_residual!r}")
        return cls(layer, draft_vocab, target_hidden, ids, norm_before_residual)

    def aux_layers(self, num_target_layers: int) -> tuple[int, ...]:
        """The target layers whose hidden states the head is fed: the config's ids, else vLLM's default; each
        must be in ``[0, num_target_layers]`` (``ValueError`` otherwise)."""
        ids = self.aux_layer_ids if self.aux_layer_ids is not None else default_aux_layers(num_target_layers)
        bad = [i for i in ids if not 0 <= i <= num_target_layers]
        if bad:
            where = "eagle_aux_hidden_state_layer_ids" if self.aux_layer_ids is not None else "the default layers"
            raise ValueError(f"{where} {list(ids)} name layers outside the target's 0..{num_target_layers} "
                             f"(it has {num_target_layers} layers)")
        return tuple(ids)

    def check_target(self, target: ModelConfig) -> None:
        """``ValueError`` when this head cannot draft for ``target`` (vocabulary, hidden sizes, layers)."""
        if self.layer.vocab_size != target.vocab_size:
            raise ValueError(f"the EAGLE-3 head's vocab_size ({self.layer.vocab_size}) is not the target's "
                             f"({target.vocab_size}); a head drafts for the target it was trained on")
        if self.target_hidden_size != target.hidden_size:
            raise ValueError(f"the EAGLE-3 head expects target hidden states of size {self.target_hidden_size} "
                             f"(target_hidden_size), the target's hidden_size is {target.hidden_size}")
        self.aux_layers(target.num_hidden_layers)


class Eagle3Layer(nn.Module):
    """The head's decoder layer: attention over ``cat(input_layernorm(embedding), hidden_norm(h))`` (2 * hidden
    inputs), then a llama MLP block."""

    def __init__(self, config: ModelConfig, rope: RotaryEmbedding, norm_before_residual: bool):
        super().__init__()
        h = config.hidden_size
        self.norm_before_residual = norm_before_residual
        self.input_layernorm = RMSNorm(h, config.rms_norm_eps)
        self.hidden_norm = RMSNorm(h, config.rms_norm_eps)
        self.self_attn = Attention(config, rope)
        q_size, kv_size = self.self_attn.q_size, self.self_attn.kv_size
        self.self_attn.qkv_proj = Linear(2 * h, q_size + 2 * kv_size, bias=config.qkv_bias)
        self.post_attention_layernorm = RMSNorm(h, config.rms_norm_eps)
        self.mlp = MLP(config)

    def forward(self, embeds, hidden, positions, k_cache, v_cache, meta: AttentionMetadata) -> torch.Tensor:
        if self.norm_before_residual:
            hidden = self.hidden_norm(hidden)
            residual = hidden
        else:
            residual = hidden
            hidden = self.hidden_norm(hidden)
        x = torch.cat([self.input_layernorm(embeds), hidden], dim=-1)  # (T, 2 * hidden)
        x = residual + self.self_attn(x, positions, k_cache, v_cache, meta)
        return x + self.mlp(self.post_attention_layernorm(x))


class Eagle3Head(nn.Module):
    """An EAGLE-3 head on a paged KV cache of one layer. ``forward`` takes the new tokens' ids and the hidden
    states they are fed with (``fuse`` of the target's, or the head's own), returns fp32 logits over the draft
    vocabulary and the pre-norm hidden states of the rows asked for; ``to_target_vocab`` lays logits out over
    the target's vocabulary. Without its own ``embed_tokens`` it embeds with the target's embedding
    (``share_embedding``)."""

    def __init__(self, config: Eagle3Config, max_positions: int, has_embed_tokens: bool):
        super().__init__()
        c = config.layer
        self.config = config
        self.rope = RotaryEmbedding(c, max_positions)
        self.embed_tokens = nn.Embedding(c.vocab_size, c.hidden_size) if has_embed_tokens else None
        self.fc = Linear(NUM_AUX_LAYERS * config.target_hidden_size, c.hidden_size, bias=False)
        self.midlayer = Eagle3Layer(c, self.rope, config.norm_before_residual)
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.lm_head = Linear(c.hidden_size, config.draft_vocab_size, bias=False)
        self.register_buffer("d2t", torch.zeros(config.draft_vocab_size, dtype=torch.int64))
        self._shared_embedding: tuple[nn.Embedding, ...] = ()  # the target's (not a submodule: not ours to move)
        self._target_ids: torch.Tensor | None = None  # int64 [draft_vocab_size]: i + d2t[i], None if the identity

    def share_embedding(self, embedding: nn.Embedding) -> None:
        """Embed with ``embedding`` (the target's) - a head published without ``embed_tokens``."""
        if embedding.embedding_dim != self.config.layer.hidden_size:
            raise ValueError(f"the EAGLE-3 head has no embed_tokens and its hidden_size "
                             f"({self.config.layer.hidden_size}) differs from the target's embedding "
                             f"({embedding.embedding_dim}): it cannot share the target's embedding")
        self._shared_embedding = (embedding,)

    def set_vocab_map(self, d2t: torch.Tensor) -> None:
        """Take ``d2t`` (int64 ``[draft_vocab_size]``, draft id i -> target id ``i + d2t[i]``)."""
        with torch.no_grad():
            self.d2t.copy_(d2t.to(self.d2t.device, torch.int64))
        identity = self.config.draft_vocab_size == self.config.layer.vocab_size and not bool(self.d2t.any())
        self._target_ids = None if identity else torch.arange(self.config.draft_vocab_size,
                                                              device=self.d2t.device) + self.d2t

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        embedding = self.embed_tokens if self.embed_tokens is not None else self._shared_embedding[0]
        return embedding(input_ids).to(self.fc.weight.dtype)

    @torch.inference_mode()
    def fuse(self, aux_hidden: torch.Tensor) -> torch.Tensor:
        """``fc`` of the target's concatenated hidden states ``[N, 3 * H_target]`` -> ``[N, H]`` (head dtype)."""
        return self.fc(aux_hidden.to(self.fc.weight.dtype))

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,  # int64 (T,) target ids
        positions: torch.Tensor,  # int64 (T,)
        hidden: torch.Tensor,  # (T, H) fused target hidden states, or the head's own outputs
        kv_cache: tuple[torch.Tensor, torch.Tensor],  # each (1, num_blocks, block_size, Hkv, D)
        meta: AttentionMetadata,
        logits_indices: torch.Tensor,  # int64 (N,)
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(fp32 logits ``[N, draft_vocab_size]``, pre-norm hidden states ``[N, H]``) of the rows asked for."""
        k_caches, v_caches = kv_cache
        x = self.midlayer(self.embed(input_ids), hidden.to(self.fc.weight.dtype), positions, k_caches[0],
                          v_caches[0], meta)
        x = x[logits_indices]
        return self.lm_head(self.norm(x)).float(), x

    @torch.inference_mode()
    def to_target_vocab(self, logits: torch.Tensor) -> torch.Tensor:
        """Draft-vocabulary logits ``[N, draft_vocab_size]`` laid out over the target's ``[N, vocab_size]``:
        draft id i at target id ``i + d2t[i]``, ``OUTSIDE_DRAFT_VOCAB`` elsewhere (probability exactly 0 there)."""
        if self._target_ids is None:
            return logits
        out = logits.new_full((logits.shape[0], self.config.layer.vocab_size), OUTSIDE_DRAFT_VOCAB)
        return out.index_copy_(1, self._target_ids, logits)

    # --- loading -------------------------------------------------------------------------------------------
    _FUSED = {"q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
              "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1)}

    def load_published(self, tensors: dict[str, torch.Tensor]) -> None:
        """Load tensors already checked by ``checkpoint.eagle3.check_layout`` (canonical names), fusing q/k/v and
        gate/up."""
        params = dict(self.named_parameters())
        fused: dict[str, dict[int, torch.Tensor]] = {}
        with torch.no_grad():
            for name, tensor in tensors.items():
                if name in ("d2t", "t2d"):
                    continue
                for fragment, (target, shard) in self._FUSED.items():
                    if f".{fragment}." in name:
                        fused.setdefault(name.replace(fragment, target), {})[shard] = tensor
                        break
                else:
                    params[name].copy_(tensor.to(params[name].dtype))
            for name, parts in fused.items():
                params[name].copy_(torch.cat([parts[i] for i in sorted(parts)], dim=0).to(params[name].dtype))
        self.set_vocab_map(tensors["d2t"] if "d2t" in tensors else torch.zeros_like(self.d2t))
