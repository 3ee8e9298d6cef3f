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
):
    """Write a random tiny checkpoint to ``path`` and return the transformers model (fp32, eval).

    ``dialect``: "hub" writes rope_theta/rope_scaling/torch_dtype; "v5" writes rope_parameters/dtype.
    ``perturb_from``: copy weights from that folder's model and add Gaussian noise (a draft that mostly agrees).
    ``lm_head_std``: std of the output projection (smaller = flatter next-token distributions).
    """
    import transformers

    torch.manual_seed(seed)
    rope = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64} if rope_scaling else None
    cls_cfg = transformers.LlamaConfig if model_type == "llama" else transformers.Qwen2Config
    cfg = cls_cfg(
        vocab_size=vocab_size, hidden_size=hidden_size, intermediate_size=intermediate_size,
        num_hidden_layers=num_layers, num_attention_heads=num_heads, num_key_value_heads=num_kv_heads,
        max_position_embeddings=max_position_embeddings, rms_norm_eps=1e-5, tie_word_embeddings=tie_word_embeddings,
        rope_theta=10000.0, rope_scaling=rope, bos_token_id=None, eos_token_id=256 + 5,
    )
    cls = transformers.LlamaForCausalLM if model_type == "llama" else transformers.Qwen2ForCausalLM
    model = cls(cfg).float().eval()
    with torch.no_grad():
        # random init gives near-uniform logits; widen them so greedy decisions are clear-cut
        model.lm_head.weight.normal_(0, lm_head_std) if not tie_word_embeddings else (
            model.model.embed_tokens.weight.normal_(0, lm_head_std))
        if perturb_from is not None:
            base = cls.from_pretrained(perturb_from, dtype=torch.float32)
            model.load_state_dict(base.state_dict())
            gen = torch.Generator().manual_seed(seed + 1)
            for p in model.parameters():
                p.add_(torch.randn(p.shape, generator=gen) * perturb_scale * p.std().clamp(min=1e-3))
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
