"""A hand-written Llama / Qwen2 forward in plain torch whose attention reads a paged KV cache.

One call takes a ragged batch - prefill chunks, single-token decodes and k+1-token verification windows of
several sequences, all flattened into ``T`` tokens - and returns logits only for the rows asked for.
``positions`` (rope) and ``slot_mapping`` (where each new K/V is written) are separate inputs: in a token
tree they differ.

Weights use Hugging Face names on disk; q/k/v and gate/up are fused into one matmul each at load time
(fewer, larger GEMMs - the gpt-fast / vLLM layout).

Over 300 lines because the blocks (RMSNorm, Attention, MLP, DecoderLayer) and the model read best together, as in
gpt-fast's model.py, and ``load_weights`` fuses checkpoint tensors into exactly the parameters those blocks define.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch
from torch import nn

from specdec import ops
from specdec.checkpoint.safetensors_reader import TensorEntry
from specdec.distributed.comm import TPGroup
from specdec.distributed.layers import VocabParallelEmbedding
from specdec.distributed.sharding import ShardLayout
from specdec.model.config import ModelConfig
from specdec.model.linear import Linear
from specdec.model.rope import RotaryEmbedding


@dataclass
class AttentionMetadata:
    """Where a ragged batch's tokens live in the paged cache (shared by every layer of one forward)."""

    slot_mapping: torch.Tensor  # int64 [T]     flat cache slot (block * block_size + offset) of each new token
    block_tables: torch.Tensor  # int32 [B, max_blocks]  physical block ids per sequence
    seq_lens: torch.Tensor  # int32 [B]     context length per sequence, new tokens included
    cu_q_lens: torch.Tensor  # int32 [B+1]   cumulative new-token counts
    tree_mask: torch.Tensor | None = None  # bool [sum(q_len_b^2)] packed per-sequence masks (None = causal)
    tree_mask_indptr: torch.Tensor | None = None  # int32 [B+1]
    # Static: every sequence has exactly this many new tokens (T = B * uniform_q_len) and is causal - a decode,
    # a draft step or a chain verification window. Attention then takes its host-read-free static-shape path
    # (ops.paged_attention), the one CUDA graphs capture (specdec/runner/cuda_graphs.py). None: ragged batch.
    uniform_q_len: int | None = None


def _capture_layer(x: torch.Tensor, layer: int, aux_layers: tuple[int, ...], aux: torch.Tensor) -> None:
    """Copy ``x [T, hidden]`` (the residual stream entering ``layer``) into every column block of ``aux [T,
    len(aux_layers) * hidden]`` whose id in ``aux_layers`` is ``layer``."""
    hidden = x.shape[-1]
    for j, wanted in enumerate(aux_layers):
        if wanted == layer:
            aux[:, j * hidden : (j + 1) * hidden] = x


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return ops.rms_norm(x, self.weight, self.eps)

    def add_forward(self, x: torch.Tensor, residual: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """``(self(stream), stream)`` with ``stream = x + residual`` (``x`` when ``residual`` is None): the residual
        add before the norm, fused on a GPU (``ops.add_rms_norm``; ``residual``'s storage may be reused)."""
        return ops.add_rms_norm(x, residual, self.weight, self.eps)


class Attention(nn.Module):
    """GQA attention on the paged cache. Under tensor parallelism (``group``) this rank's heads only: qkv is
    column-parallel, o_proj row-parallel, followed by one all-reduce (specdec/distributed/sharding.py)."""

    def __init__(self, config: ModelConfig, rope: RotaryEmbedding, layout: ShardLayout | None = None,
                 group: TPGroup | None = None):
        super().__init__()
        layout = layout or ShardLayout.of(config)
        self.num_heads = layout.num_heads
        self.num_kv_heads = layout.num_kv_heads
        self.head_dim = config.head_dim
        self.q_size = layout.q_size
        self.kv_size = layout.kv_size
        self.scale = self.head_dim**-0.5
        self.qkv_proj = Linear(config.hidden_size, self.q_size + 2 * self.kv_size, bias=config.qkv_bias)
        self.o_proj = Linear(self.q_size, config.hidden_size, bias=config.o_proj_bias)
        self.rope = rope
        self.group = group
        self.batch_invariant = False  # row-invariant CPU attention (specdec/model/batch_invariant.py)
        self.qk_norm = config.qk_norm
        if config.qk_norm:  # Qwen3: each head's q and k normalised before rope (weights shared by the heads)
            self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps)

    def forward(
        self,
        x: torch.Tensor,  # (T, hidden)
        positions: torch.Tensor,  # (T,)
        k_cache: torch.Tensor,  # (num_blocks, block_size, Hkv, D)
        v_cache: torch.Tensor,  # (num_blocks, block_size, Hkv, D)
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        num_tokens = x.shape[0]
        # Rotate q and k, write the new K/V into their slots (one fused kernel on a GPU), then attend over each
        # sequence's whole context.
        qkv = self.qkv_proj(x)  # (T, (Hq + 2 Hkv) D)
        if self.qk_norm:
            qkv = self._norm_qk(qkv)
        q = ops.rope_write_kv(qkv, positions, self.rope.cos, self.rope.sin, k_cache, v_cache,
                              meta.slot_mapping, self.num_heads, self.num_kv_heads)  # (T, Hq, D)
        out = ops.paged_attention(
            q, k_cache, v_cache, meta.block_tables, meta.seq_lens, meta.cu_q_lens, self.scale,
            meta.tree_mask, meta.tree_mask_indptr, uniform_q_len=meta.uniform_q_len, invariant=self.batch_invariant,
        )  # (T, Hq, D)
        out = self.o_proj(out.reshape(num_tokens, self.q_size))  # (T, hidden): this rank's heads' share
        return out if self.group is None else self.group.all_reduce(out)


    def _norm_qk(self, qkv: torch.Tensor) -> torch.Tensor:
        """``qkv`` (T, (Hq + 2 Hkv) D) with every head of q and k RMS-normalised over D (Qwen3's QK norm)."""
        t, d = qkv.shape[0], self.head_dim
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = self.q_norm(q.reshape(t * self.num_heads, d)).reshape(t, self.q_size)
        k = self.k_norm(k.reshape(t * self.num_kv_heads, d)).reshape(t, self.kv_size)
        return torch.cat([q, k, v], dim=-1)


class MLP(nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x)), gate and up fused into one matmul. Under tensor parallelism
    (``group``) this rank's share of the intermediate features, followed by one all-reduce."""

    def __init__(self, config: ModelConfig, layout: ShardLayout | None = None, group: TPGroup | None = None):
        super().__init__()
        layout = layout or ShardLayout.of(config)
        self.intermediate_size = layout.intermediate_size
        self.gate_up_proj = Linear(config.hidden_size, 2 * self.intermediate_size, bias=False)
        self.down_proj = Linear(self.intermediate_size, config.hidden_size, bias=False)
        self.group = group

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)  # (T, 2 * I / N): gate, then up
        out = self.down_proj(ops.silu_mul(gate_up))  # (T, hidden): this rank's share
        return out if self.group is None else self.group.all_reduce(out)


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, rope: RotaryEmbedding, layout: ShardLayout, group: TPGroup | None):
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Attention(config, rope, layout, group)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = MLP(config, layout, group)

    def forward(self, x, residual, positions, k_cache, v_cache, meta) -> tuple[torch.Tensor, torch.Tensor]:
        """``(mlp_out, stream)``, each ``[T, hidden]``: the residual stream leaving this layer is ``mlp_out +
        stream``, left unsummed so that the next layer's norm fuses the add (vLLM's layout). The stream entering it
        is ``x + residual`` (``x`` alone for the first layer: ``residual`` None). The same operations as ``s = s +
        attn(norm(s)); s = s + mlp(norm(s))``; on the CPU the same values bit for bit."""
        h, residual = self.input_layernorm.add_forward(x, residual)
        h = self.self_attn(h, positions, k_cache, v_cache, meta)
        h, residual = self.post_attention_layernorm.add_forward(h, residual)
        return self.mlp(h), residual


class LlamaForCausalLM(nn.Module):
    """Llama / Qwen2 decoder. ``forward`` returns fp32 logits ``[N, V]`` for the rows in ``logits_indices``.

    ``group``: this rank's tensor-parallel group (None: the whole model in this process). Then the model holds
    rank ``group.rank``'s shard (``ShardLayout``; specdec/distributed/sharding.py), every rank runs the same
    forward on the same inputs, and the logits are gathered on rank 0 - the other ranks' forwards return None.
    ``config`` stays the full model's.
    """

    # HF checkpoint name fragment -> (fused parameter fragment, shard index)
    _FUSED = {
        "q_proj": ("qkv_proj", 0),
        "k_proj": ("qkv_proj", 1),
        "v_proj": ("qkv_proj", 2),
        "gate_proj": ("gate_up_proj", 0),
        "up_proj": ("gate_up_proj", 1),
    }

    def __init__(self, config: ModelConfig, max_positions: int | None = None, group: TPGroup | None = None):
        super().__init__()
        self.config = config
        self.group = group
        self.layout = ShardLayout.of(config, group.rank, group.size) if group is not None else ShardLayout.of(config)
        self.rope = RotaryEmbedding(config, max_positions or config.max_position_embeddings)
        self.embed_tokens = (nn.Embedding(config.vocab_size, config.hidden_size) if group is None
                             else VocabParallelEmbedding(self.layout, config.hidden_size, group))
        self.layers = nn.ModuleList(DecoderLayer(config, self.rope, self.layout, group)
                                    for _ in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head = Linear(config.hidden_size, self.layout.vocab_per_rank, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,  # int64 (T,)
        positions: torch.Tensor,  # int64 (T,)
        kv_cache: tuple[torch.Tensor, torch.Tensor],  # each (L, num_blocks, block_size, Hkv, D)
        meta: AttentionMetadata,
        logits_indices: torch.Tensor,  # int64 (N,) rows of the flattened batch whose logits are wanted
    ) -> torch.Tensor:
        return self.forward_traceable(input_ids, positions, kv_cache, meta, logits_indices)

    def forward_traceable(
        self,
        input_ids: torch.Tensor,  # int64 (T,)
        positions: torch.Tensor,  # int64 (T,)
        kv_cache: tuple[torch.Tensor, torch.Tensor],  # each (L, num_blocks, block_size, Hkv, D)
        meta: AttentionMetadata,
        logits_indices: torch.Tensor,  # int64 (N,)
    ) -> torch.Tensor:
        """``forward`` without its ``inference_mode`` decorator, for ``torch.compile`` (call it under
        ``torch.no_grad()``): Dynamo fails on the K/V cache writes inside inference mode ("Cannot set
        version_counter for inference tensor", torch 2.13). Same inputs and output as ``forward``."""
        x = self._decoder(input_ids, positions, kv_cache, meta)  # (T, hidden)
        return self.logits(self.norm(x[logits_indices]))  # (N, V)

    def final_hidden_states(
        self,
        input_ids: torch.Tensor,  # int64 (T,)
        positions: torch.Tensor,  # int64 (T,)
        kv_cache: tuple[torch.Tensor, torch.Tensor],
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        """The final-norm hidden states of every new token, model dtype ``[T, hidden]`` (the static forward of
        specdec/runner/cuda_graphs.py captures this and applies :meth:`logits` to the rows it needs). No
        ``inference_mode`` decorator (see ``forward_traceable``)."""
        return self.norm(self._decoder(input_ids, positions, kv_cache, meta))

    def logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """fp32 logits ``[N, V]`` of final-norm hidden states ``[N, hidden]``. Under tensor parallelism each rank
        computes its vocabulary shard ``[N, V / size]`` and rank 0 gathers them (one gather per forward; the other
        ranks get None)."""
        logits = self.lm_head(hidden).float()  # (N, V) or (N, V / size)
        if self.group is None:
            return logits
        full = self.group.gather_last_dim(logits)  # (N, size * V / size) on rank 0, None elsewhere
        return None if full is None else full[:, : self.config.vocab_size]

    @torch.inference_mode()
    def forward_with_aux_hidden(
        self,
        input_ids: torch.Tensor,  # int64 (T,)
        positions: torch.Tensor,  # int64 (T,)
        kv_cache: tuple[torch.Tensor, torch.Tensor],
        meta: AttentionMetadata,
        logits_indices: torch.Tensor,  # int64 (N,)
        aux_layers: tuple[int, ...],
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``forward``, and the hidden states of every new token entering the layers ``aux_layers`` (id k: the
        residual stream before layer k, as vLLM numbers them - transformers' ``hidden_states[k]`` for k < L, 0 the
        embeddings; ``L`` the last layer's output before the final norm), concatenated in that order: ``(logits
        fp32 [N, V], aux [T, len(aux_layers) * hidden])``, aux in the model's dtype. The same operations as
        ``forward`` (the logits are bitwise the same); each captured layer costs one ``[T, hidden]`` copy
        (EAGLE-3 heads)."""
        hidden = self.config.hidden_size
        aux = self.embed_tokens.weight.new_empty(input_ids.shape[0], len(aux_layers) * hidden)
        x = self._decoder(input_ids, positions, kv_cache, meta, capture=(aux_layers, aux))
        return self.logits(self.norm(x[logits_indices])), aux

    def _decoder(self, input_ids, positions, kv_cache, meta: AttentionMetadata,
                 capture: tuple[tuple[int, ...], torch.Tensor] | None = None) -> torch.Tensor:
        k_caches, v_caches = kv_cache
        x = self.embed_tokens(input_ids)  # (T, hidden)
        residual = None  # the residual stream is x + residual (x alone before the first layer)
        for i, layer in enumerate(self.layers):
            if capture is not None:
                _capture_layer(x if residual is None else x + residual, i, *capture)
            x, residual = layer(x, residual, positions, k_caches[i], v_caches[i], meta)
        x = x if residual is None else x + residual  # (T, hidden), the last layer's output
        if capture is not None:
            _capture_layer(x, len(self.layers), *capture)
        return x  # (T, hidden), before the final norm

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor | TensorEntry]]) -> None:
        """Load HF-named tensors (in memory, or ``TensorEntry``s read straight into place), each q/k/v and gate/up
        part written into its rows of the fused parameter (no concatenated copy); ``ValueError`` on missing,
        unknown or mis-shaped ones. A source that is the parameter itself (a shared embedding) is taken as is."""
        params = dict(self.named_parameters(remove_duplicate=False))
        loaded: set[str] = set()
        fused_parts: dict[str, set[int]] = {}
        for hf_name, full_source in weights:
            name = hf_name.removeprefix("model.")
            if "rotary_emb" in name:
                continue
            if params.get(name) is full_source:  # already the parameter: a self draft's shared embedding (shard)
                loaded.add(name)
                continue
            source = self.layout.slice_of(hf_name, full_source)  # this rank's share (the whole tensor at size 1)
            if name in ("embed_tokens.weight", "lm_head.weight") and name in params:
                param = params[name].data  # (V / size, hidden): the last shard's padding rows stay zero
                param[source.shape[0] :].zero_()
                _write(param[: source.shape[0]], source, hf_name)
                loaded.add(name)
                continue
            for fragment, (fused, shard) in self._FUSED.items():
                if f".{fragment}." in name:
                    fused_name = name.replace(fragment, fused)
                    start, rows = self._fused_rows(fused, shard)
                    _write(_param(params, fused_name, hf_name).data[start : start + rows], source, hf_name)
                    fused_parts.setdefault(fused_name, set()).add(shard)
                    break
            else:
                if name == "lm_head.weight" and name not in params:
                    continue
                _write(_param(params, name, hf_name).data, source, hf_name)
                loaded.add(name)
        for fused_name, parts in fused_parts.items():
            expected = 3 if "qkv" in fused_name else 2
            if len(parts) != expected:
                raise ValueError(f"checkpoint has only {len(parts)} of the {expected} tensors fused into {fused_name}")
            loaded.add(fused_name)
        if self.config.tie_word_embeddings:
            loaded.add("lm_head.weight")
        missing = sorted(set(params) - loaded)
        if missing:
            raise ValueError(f"checkpoint is missing weights: {missing[:8]}{' ...' if len(missing) > 8 else ''}")

    def _fused_rows(self, fused: str, shard: int) -> tuple[int, int]:
        """(first row, rows) of part ``shard`` in the fused parameter ``fused`` ("qkv_proj" or "gate_up_proj"), this
        rank's share of it under tensor parallelism."""
        lay = self.layout
        if fused == "qkv_proj":
            q, kv = lay.q_size, lay.kv_size
            return ((0, q), (q, kv), (q + kv, kv))[shard]
        return shard * lay.intermediate_size, lay.intermediate_size


def _param(params: dict[str, nn.Parameter], name: str, source: str) -> nn.Parameter:
    param = params.get(name)
    if param is None:
        raise ValueError(f"checkpoint tensor {source!r} does not belong to this architecture")
    return param


def _write(dest: torch.Tensor, source: torch.Tensor | TensorEntry, name: str) -> None:
    """Fill ``dest`` (a parameter's data, or rows of it) with ``source``, converted to ``dest``'s dtype."""
    if tuple(source.shape) != tuple(dest.shape):
        raise ValueError(f"checkpoint tensor {name!r} has shape {tuple(source.shape)}, expected {tuple(dest.shape)}")
    with torch.no_grad():
        if isinstance(source, torch.Tensor):
            dest.copy_(source)
        else:
            source.read_into(dest)
