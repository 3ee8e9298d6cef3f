"""EAGLE-3 heads on disk: the published layout, its validation (``check_layout``) and loading a head
(``load_eagle3_head``) into the forward of specdec/model/eagle3.py.

The layout is the one vLLM (``vllm/model_executor/models/llama_eagle3.py``), SGLang
(``python/sglang/srt/models/llama_eagle3.py``), SpecForge (``specforge/modeling/draft/llama3_eagle.py``) and
``speculators`` read and write for ``architectures: ["LlamaForCausalLMEagle3"]`` (vLLM also registers the name
``Eagle3LlamaForCausalLM``):

- ``config.json``: a llama config with ``num_hidden_layers: 1``, plus ``draft_vocab_size`` (the LM head's rows;
  default ``vocab_size``), ``target_hidden_size`` (default ``hidden_size``), optionally
  ``eagle_config.eagle_aux_hidden_state_layer_ids`` (or the same key at the top level) and
  ``norm_before_residual``. ``vocab_size`` is the target's vocabulary (the embedding's rows).
- tensors: ``fc.weight [H, 3 * H_target]`` (the low/mid/high target hidden states, concatenated, fused into one),
  one decoder layer ``midlayer.*`` (written ``layers.0.*`` by ``speculators``; vLLM renames ``midlayer.`` to
  ``layers.0.``) whose q/k/v projections take ``2 * H`` inputs - the normed token embedding (``input_layernorm``)
  concatenated with the normed fused hidden state (``hidden_norm``) - and whose o_proj / MLP / post-attention norm
  are a llama layer's; the final ``norm.weight``; ``lm_head.weight [draft_vocab_size, H]``; ``d2t`` (int64
  ``[draft_vocab_size]``, an offset: draft id i is target id ``i + d2t[i]``) and ``t2d`` (bool ``[vocab_size]``,
  which target ids the draft vocabulary has; informative). ``embed_tokens.weight`` is optional: published heads
  leave it out and use the target's embedding.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Iterator

import torch
from torch import nn

from specdec.checkpoint.loader import iter_weights
from specdec.model.config import ModelConfig
from specdec.model.eagle3 import NUM_AUX_LAYERS, Eagle3Config, Eagle3Head
from specdec.model.linear import prepack_linears, prepack_supported


def published_tensors(config: Eagle3Config) -> tuple[dict[str, tuple[int, ...]], dict[str, tuple[int, ...]]]:
    """(required, optional): the published EAGLE-3 tensor names (``midlayer.*`` spelling) and their shapes."""
    c = config.layer
    h, q, kv = c.hidden_size, c.num_attention_heads * c.head_dim, c.num_key_value_heads * c.head_dim
    required = {
        "fc.weight": (h, NUM_AUX_LAYERS * config.target_hidden_size),
        "midlayer.input_layernorm.weight": (h,),
        "midlayer.hidden_norm.weight": (h,),
        "midlayer.self_attn.q_proj.weight": (q, 2 * h),
        "midlayer.self_attn.k_proj.weight": (kv, 2 * h),
        "midlayer.self_attn.v_proj.weight": (kv, 2 * h),
        "midlayer.self_attn.o_proj.weight": (h, q),
        "midlayer.post_attention_layernorm.weight": (h,),
        "midlayer.mlp.gate_proj.weight": (c.intermediate_size, h),
        "midlayer.mlp.up_proj.weight": (c.intermediate_size, h),
        "midlayer.mlp.down_proj.weight": (h, c.intermediate_size),
        "norm.weight": (h,),
        "lm_head.weight": (config.draft_vocab_size, h),
    }
    if c.qkv_bias:
        required |= {"midlayer.self_attn.q_proj.bias": (q,), "midlayer.self_attn.k_proj.bias": (kv,),
                     "midlayer.self_attn.v_proj.bias": (kv,)}
    if c.o_proj_bias:
        required["midlayer.self_attn.o_proj.bias"] = (h,)
    optional = {"embed_tokens.weight": (c.vocab_size, h), "t2d": (c.vocab_size,)}
    # d2t is the identity (all zeros) when the draft vocabulary is the target's: vLLM loads a head without it then
    (required if config.draft_vocab_size < c.vocab_size else optional)["d2t"] = (config.draft_vocab_size,)
    return required, optional


def canonical_name(name: str) -> str:
    """A checkpoint name in the ``midlayer.*`` spelling: a leading ``model.`` dropped, ``layers.0.`` (as
    ``speculators`` writes the one layer) read as ``midlayer.``."""
    name = name.removeprefix("model.")
    if name.startswith("layers.0."):
        name = "midlayer." + name.removeprefix("layers.0.")
    return name


def check_layout(tensors: dict[str, torch.Tensor], config: Eagle3Config, source: str) -> None:
    """``ValueError`` unless ``tensors`` (canonical names) are an EAGLE-3 head in the published layout: every
    required tensor present with its shape, nothing unknown, ``d2t`` / ``t2d`` a consistent vocabulary map."""
    required, optional = published_tensors(config)
    missing = sorted(set(required) - set(tensors))
    if missing:
        raise ValueError(f"{source} is not an EAGLE-3 head in the published layout: missing {missing}")
    unknown = sorted(set(tensors) - set(required) - set(optional))
    if unknown:
        raise ValueError(f"{source} has tensors the EAGLE-3 layout does not have: {unknown[:8]}"
                         f"{' ...' if len(unknown) > 8 else ''}")
    for name, tensor in tensors.items():
        shape = (required | optional)[name]
        if tuple(tensor.shape) != shape:
            raise ValueError(f"{source}: tensor {name!r} has shape {tuple(tensor.shape)}, expected {shape}")
    vocab, draft_vocab = config.layer.vocab_size, config.draft_vocab_size
    d2t = tensors.get("d2t")
    if d2t is not None:
        if d2t.dtype.is_floating_point or d2t.dtype == torch.bool:
            raise ValueError(f"{source}: d2t must hold integer offsets, got {d2t.dtype}")
        target_ids = torch.arange(draft_vocab) + d2t.long()
        if bool(((target_ids < 0) | (target_ids >= vocab)).any()) or target_ids.unique().numel() != draft_vocab:
            raise ValueError(f"{source}: d2t does not map the {draft_vocab} draft ids to distinct target ids in "
                             f"[0, {vocab}) (draft id i is target id i + d2t[i])")
        t2d = tensors.get("t2d")
        if t2d is not None and (int(t2d.bool().sum()) != draft_vocab or not bool(t2d.bool()[target_ids].all())):
            raise ValueError(f"{source}: t2d does not mark exactly the target ids d2t maps to")


def iter_head_weights(path: str) -> Iterator[tuple[str, torch.Tensor]]:
    """The head's tensors: its ``*.safetensors`` (as any model folder), else a ``pytorch_model.bin`` (several
    published heads ship one; read with ``weights_only=True``)."""
    binary = os.path.join(path, "pytorch_model.bin")
    has_safetensors = any(f.endswith(".safetensors") for f in os.listdir(path))
    if has_safetensors or not os.path.isfile(binary):
        yield from iter_weights(path)
        return
    try:
        state = torch.load(binary, map_location="cpu", weights_only=True)
    except Exception as e:  # noqa: BLE001 - a corrupt or pickled-code file: say which
        raise ValueError(f"weight file {binary} is unreadable as plain tensors: {e}") from e
    yield from state.items()


def read_head_tensors(weights: Iterable[tuple[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Canonical name -> tensor (rotary tables, which some exports carry, are dropped: they are computed)."""
    return {canonical_name(name): t for name, t in weights if "rotary_emb" not in name}


def load_eagle3_head(path: str, dtype: torch.dtype, device: torch.device, max_positions: int,
                     target: ModelConfig, target_embedding: Callable[[], nn.Embedding],
                     prepack_weights: bool | None = None) -> Eagle3Head:
    """Load the EAGLE-3 head in folder ``path`` to draft for ``target``: config and tensors checked against
    the published layout (``ValueError`` naming what is missing or does not fit), weights in ``dtype`` on
    ``device``; without its own ``embed_tokens`` it shares the embedding ``target_embedding()`` returns (called
    only then: under tensor parallelism it reads the target's whole embedding for rank 0)."""
    config = Eagle3Config.from_json(path)
    config.check_target(target)
    tensors = read_head_tensors(iter_head_weights(path))
    check_layout(tensors, config, f"the EAGLE-3 head at {path}")
    with torch.device("meta"):
        head = Eagle3Head(config, max_positions, has_embed_tokens="embed_tokens.weight" in tensors)
    head = head.to_empty(device=device).to(dtype)
    head.rope.reset(device)
    with torch.no_grad():
        head.d2t.zero_()
    head.load_published(tensors)
    if head.embed_tokens is None:
        head.share_embedding(target_embedding())
    if prepack_weights is not False and prepack_supported(dtype, torch.device(device)):
        prepack_linears(head, required=prepack_weights is True)
    return head.eval()
