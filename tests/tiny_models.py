"""Tiny random checkpoints written to disk as real HF folders (config.json + model.safetensors + tokenizer.json).

transformers builds the same config as LlamaForCausalLM / Qwen2ForCausalLM: it initialises the weights, saves
them, and serves as the logits oracle.
"""

from __future__ import annotations

import json
import os

import torch

EOS_TOKEN = "<|eos|>"


def byte_tokenizer_json() -> str:
    """A byte-level BPE tokenizer: 256 byte tokens, a few merges, one special eos token (id 256+merges)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from tokenizers.pre_tokenizers import ByteLevel

    alphabet = ByteLevel.alphabet()
    vocab = {ch: i for i, ch in enumerate(sorted(alphabet))}
    merges = [("Ġ", "t"), ("h", "e"), ("Ġt", "he"), ("i", "n"), ("a", "n")]
    for a, b in merges:
        vocab[a + b] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([EOS_TOKEN])
    return tok.to_str()


CHAT_TEMPLATE = (
    "{% for message in messages %}<|{{ message['role'] }}|>{{ message['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def make_tiny_model(
    path: str,
    model_type: str = "llama",
    dialect: str = "hub",
    seed: int = 0,
    vocab_size: int = 300,
    hidden_size: int = 64,
    num_layers: int = 2,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    intermediate_size: int = 128,
    tie_word_embeddings: bool = False,
    rope_scaling: bool = False,
    max_position_embeddings: int = 512,
    with_tokenizer: bool = True,
    perturb_from: str | None = None,
    perturb_scale: float = 0.0,
    lm_head_std: float = 0.5,
    layer_output_scale: float = 1.0,
    extra_config: dict | None = None,
):
    """Write a random tiny checkpoint to ``path`` and return the transformers model (fp32, eval).

    ``dialect``: "hub" writes rope_theta/rope_scaling/torch_dtype; "v5" writes rope_parameters/dtype.
    ``perturb_from``: copy weights from that folder's model and add Gaussian noise (a draft that mostly agrees).
    ``lm_head_std``: std of the output projection (smaller = flatter next-token distributions).
    ``extra_config``: more fields of the family's config (e.g. a Mistral ``sliding_window``).
    ``layer_output_scale``: scales every layer's o_proj and down_proj (below 1 the residual stream stays close to
    the token's embedding: the next token is mostly a function of the last one, which a tiny EAGLE-3 head built by
    ``make_tiny_eagle3_head`` can predict).
    """
    import transformers

    torch.manual_seed(seed)
    rope = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64} if rope_scaling else None
    families = {"llama": ("LlamaConfig", "LlamaForCausalLM"), "qwen2": ("Qwen2Config", "Qwen2ForCausalLM"),
                "qwen3": ("Qwen3Config", "Qwen3ForCausalLM"), "mistral": ("MistralConfig", "MistralForCausalLM")}
    cls_cfg, cls = (getattr(transformers, name) for name in families[model_type])
    extra = dict(extra_config or {})
    if model_type == "qwen3":
        extra.setdefault("head_dim", 2 * hidden_size // num_heads)  # Qwen3's head_dim is its own, not hidden / heads
    cfg = cls_cfg(
        vocab_size=vocab_size, hidden_size=hidden_size, intermediate_size=intermediate_size,
        num_hidden_layers=num_layers, num_attention_heads=num_heads, num_key_value_heads=num_kv_heads,
        max_position_embeddings=max_position_embeddings, rms_norm_eps=1e-5, tie_word_embeddings=tie_word_embeddings,
        rope_theta=10000.0, rope_scaling=rope, bos_token_id=None, eos_token_id=256 + 5, **extra,
    )
    model = cls(cfg).float().eval()
    with torch.no_grad():
        # random init gives near-uniform logits; widen them so greedy decisions are clear-cut
        model.lm_head.weight.normal_(0, lm_head_std) if not tie_word_embeddings else (
            model.model.embed_tokens.weight.normal_(0, lm_head_std))
        if model_type == "qwen3":  # QK-norm weights other than ones, so loading them is tested
            for layer in model.model.layers:
                layer.self_attn.q_norm.weight.normal_(1.0, 0.3)
                layer.self_attn.k_norm.weight.normal_(1.0, 0.3)
        if perturb_from is not None:
            base = cls.from_pretrained(perturb_from, dtype=torch.float32)
            model.load_state_dict(base.state_dict())
            gen = torch.Generator().manual_seed(seed + 1)
            for p in model.parameters():
                p.add_(torch.randn(p.shape, generator=gen) * perturb_scale * p.std().clamp(min=1e-3))
        if layer_output_scale != 1.0:
            for layer in model.model.layers:
                layer.self_attn.o_proj.weight.mul_(layer_output_scale)
                layer.mlp.down_proj.weight.mul_(layer_output_scale)
    model.save_pretrained(path)
    _rewrite_config(os.path.join(path, "config.json"), model_type, dialect, rope)
    if with_tokenizer:
        with open(os.path.join(path, "tokenizer.json"), "w") as f:
            f.write(byte_tokenizer_json())
        with open(os.path.join(path, "tokenizer_config.json"), "w") as f:
            json.dump({"chat_template": CHAT_TEMPLATE, "eos_token": EOS_TOKEN, "add_bos_token": False}, f)
    return model


def _rewrite_config(file: str, model_type: str, dialect: str, rope: dict | None) -> None:
    """Write config.json explicitly in the asked dialect (whatever this transformers version saves)."""
    with open(file) as f:
        raw = json.load(f)
    for key in ("rope_theta", "rope_scaling", "rope_parameters", "torch_dtype", "dtype"):
        raw.pop(key, None)
    if dialect == "hub":
        raw["rope_theta"] = 10000.0
        raw["rope_scaling"] = rope
        raw["torch_dtype"] = "float32"
    else:
        raw["rope_parameters"] = {"rope_type": "default", "rope_theta": 10000.0} if rope is None else {
            **rope, "rope_theta": 10000.0}
        raw["dtype"] = "float32"
    raw["model_type"] = model_type
    with open(file, "w") as f:
        json.dump(raw, f, indent=2)


def make_tiny_eagle3_head(
    path: str,
    target_dir: str,
    seed: int = 0,
    draft_ids: list[int] | None = None,
    aux_layer_ids: list[int] | None = None,
    structured: bool = True,
    num_heads: int = 4,
    intermediate_size: int = 96,
    with_embed_tokens: bool = False,
    layer_prefix: str = "midlayer.",
    norm_before_residual: bool | None = None,
    extra_config: dict | None = None,
) -> dict:
    """Write an EAGLE-3 head for the target at ``target_dir`` in the published layout (``LlamaForCausalLMEagle3``
    config, ``midlayer.*`` / ``fc`` / ``norm`` / ``lm_head`` / ``d2t`` / ``t2d`` tensors); returns its tensors.

    ``draft_ids``: the target ids of the draft vocabulary, ascending (None: the whole target vocabulary, d2t all
    zeros). ``layer_prefix``: ``"midlayer."`` (SpecForge, vLLM, SGLang) or ``"layers.0."`` (speculators).
    ``structured``: attention that mostly attends to the entry's own token and the target's LM head rows, so the
    head drafts roughly what the target predicts after a token (acceptance well above chance on a tiny target);
    otherwise every weight is random (drafts near chance, every input matters: for checking the forward).
    """
    from safetensors.torch import load_file, save_file

    with open(os.path.join(target_dir, "config.json")) as f:
        target = json.load(f)
    weights = load_file(os.path.join(target_dir, "model.safetensors"))
    hidden, vocab = target["hidden_size"], target["vocab_size"]
    head_dim = hidden // num_heads
    draft_ids = list(range(vocab)) if draft_ids is None else list(draft_ids)
    draft_vocab = len(draft_ids)
    gen = torch.Generator().manual_seed(seed)

    def randn(*shape, std=1.0):
        return torch.randn(*shape, generator=gen) * std

    eye = torch.eye(hidden)
    target_head = weights.get("lm_head.weight", weights["model.embed_tokens.weight"])
    ids = torch.tensor(draft_ids)
    if structured:  # q = 4 * k = v = the normed embedding (heads see their slice): attention picks its own entry
        qkv = [torch.cat([scale * eye, randn(hidden, hidden, std=0.01)], dim=1) for scale in (4.0, 1.0, 1.0)]
        o_proj, lm_head = eye + randn(hidden, hidden, std=0.01), target_head[ids].clone()
        fc_std, down_std, norm = 0.02, 0.02, torch.ones(hidden)
    else:
        qkv = [randn(hidden, 2 * hidden, std=0.15) for _ in range(3)]
        o_proj, lm_head = randn(hidden, hidden, std=0.15), randn(draft_vocab, hidden, std=0.5)
        fc_std, down_std, norm = 0.1, 0.1, 1 + randn(hidden, std=0.1)
    p = layer_prefix
    tensors = {
        "fc.weight": randn(hidden, 3 * hidden, std=fc_std),
        f"{p}input_layernorm.weight": norm.clone(),
        f"{p}hidden_norm.weight": norm.clone() if structured else 1 + randn(hidden, std=0.1),
        f"{p}self_attn.q_proj.weight": qkv[0],
        f"{p}self_attn.k_proj.weight": qkv[1],
        f"{p}self_attn.v_proj.weight": qkv[2],
        f"{p}self_attn.o_proj.weight": o_proj,
        f"{p}post_attention_layernorm.weight": norm.clone(),
        f"{p}mlp.gate_proj.weight": randn(intermediate_size, hidden, std=0.1),
        f"{p}mlp.up_proj.weight": randn(intermediate_size, hidden, std=0.1),
        f"{p}mlp.down_proj.weight": randn(hidden, intermediate_size, std=down_std),
        "norm.weight": norm.clone() if structured else 1 + randn(hidden, std=0.1),
        "lm_head.weight": lm_head,
        "d2t": ids - torch.arange(draft_vocab),
        "t2d": torch.zeros(vocab, dtype=torch.bool).index_fill_(0, ids, True),
    }
    if with_embed_tokens:
        # structured: a copy of the target's (drafts as well as a head that shares it); else random
        tensors["embed_tokens.weight"] = (weights["model.embed_tokens.weight"].clone() if structured
                                          else randn(vocab, hidden, std=0.02))
    config = {
        "architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama", "hidden_act": "silu",
        "hidden_size": hidden, "intermediate_size": intermediate_size, "num_hidden_layers": 1,
        "num_attention_heads": num_heads, "num_key_value_heads": num_heads, "head_dim": head_dim,
        "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "rope_scaling": None, "torch_dtype": "float32",
        "max_position_embeddings": target["max_position_embeddings"], "tie_word_embeddings": False,
        "vocab_size": vocab, "draft_vocab_size": draft_vocab, "target_hidden_size": hidden,
    }
    if aux_layer_ids is not None:
        config["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": list(aux_layer_ids), "use_aux_hidden_state": True}
    if norm_before_residual is not None:
        config["norm_before_residual"] = norm_before_residual
    config.update(extra_config or {})
    os.makedirs(path, exist_ok=True)
    save_file({k: v.contiguous() for k, v in tensors.items()}, os.path.join(path, "model.safetensors"))
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
    return tensors
