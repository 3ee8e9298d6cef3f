"""Random-weight Llama checkpoints written straight to safetensors in their own dtype (bf16 on the GPU).

``tests/tiny_models.make_tiny_model`` builds the model in transformers in fp32 and saves it: for a 3B-shaped model
that is ~12 GB of fp32 and minutes of CPU init. Here the tensors are drawn on the device (CUDA when there is one)
straight in the target dtype, in HF names, with the config and the byte tokenizer of ``tiny_models`` (the token
ids are what matters; text is never looked at). Initialisation as transformers' Llama: linear weights N(0, 0.02),
norms 1, the tied embedding N(0, ``embed_std`` = 0.02) too (a larger one, as ``tiny_models`` uses, makes a random
model with tied embeddings echo its input token: every draft would agree).

``damp_from`` / ``damp``: the attention output and MLP down projections of layers >= ``damp_from`` are scaled by
``damp``, so those layers barely move the residual stream. Such a model costs a full forward but decides almost
like its first ``damp_from`` layers: with ``truncate_to=damp_from`` (the same seed, the first layers only) that
gives a cheap draft of high, measured acceptance for a random target.
"""

from __future__ import annotations

import json
import math
import os

import torch

LLAMA_1B = dict(hidden_size=2048, num_layers=16, num_heads=32, num_kv_heads=8, intermediate_size=8192,
                vocab_size=128256)  # fmt: skip
LLAMA_3B = dict(hidden_size=3072, num_layers=28, num_heads=24, num_kv_heads=8, intermediate_size=8192,
                vocab_size=128256)  # fmt: skip
TINY = dict(hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=128, vocab_size=512)
EOS_ID = 261  # tiny_models' byte tokenizer: 256 bytes + 5 merges, then <|eos|>


def write_random_llama(path: str, *, hidden_size: int, num_layers: int, num_heads: int, num_kv_heads: int,
                       intermediate_size: int, vocab_size: int, dtype: torch.dtype = torch.bfloat16, seed: int = 0,
                       embed_std: float = 0.02, damp_from: int | None = None, damp: float = 1.0,
                       truncate_to: int | None = None, max_position_embeddings: int = 4096,
                       device: str | None = None, tie_word_embeddings: bool = True,
                       shard_bytes: int | None = None) -> str:  # fmt: skip
    """Write ``config.json``, the weights and the tokenizer files to ``path``; returns ``path``.

    Layer i's tensors depend only on (seed, i), so ``truncate_to=n`` writes exactly the first n layers of the
    model the same seed gives without it (embedding and final norm shared). ``tie_word_embeddings=False`` adds an
    ``lm_head.weight`` of its own. ``shard_bytes``: write ``model-0000i-of-0000n.safetensors`` files of at most about
    that many bytes each (whole tensors) and a ``model.safetensors.index.json``, drawing one shard at a time, so a
    7B-shaped checkpoint is built holding one shard in memory; None: one ``model.safetensors``."""
    from safetensors.torch import save_file

    # NOTE: bench.gpu runs with tests/ on PYTHONPATH; bench.memory.footprint runs from the repo root (tests/ is a
    # folder)
    try:
        from tiny_models import CHAT_TEMPLATE, EOS_TOKEN, byte_tokenizer_json
    except ImportError:
        from tests.tiny_models import CHAT_TEMPLATE, EOS_TOKEN, byte_tokenizer_json

    if shard_bytes is not None and shard_bytes <= 0:
        raise ValueError(f"shard_bytes must be positive or None, got {shard_bytes}")
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    os.makedirs(path, exist_ok=True)
    head_dim = hidden_size // num_heads
    layers = num_layers if truncate_to is None else truncate_to

    # the plan: (name, shape, std or None for ones, generator key); tensors are drawn only when their shard is written
    plan = [("model.embed_tokens.weight", (vocab_size, hidden_size), embed_std, 1),
            ("model.norm.weight", (hidden_size,), None, 0)]  # fmt: skip
    if not tie_word_embeddings:
        plan.append(("lm_head.weight", (vocab_size, hidden_size), 0.02, 2))
    for i in range(layers):
        scale = damp if damp_from is not None and i >= damp_from else 1.0
        pre, key = f"model.layers.{i}.", 100 * (i + 1)
        shapes = {
            "self_attn.q_proj.weight": ((num_heads * head_dim, hidden_size), 0.02),
            "self_attn.k_proj.weight": ((num_kv_heads * head_dim, hidden_size), 0.02),
            "self_attn.v_proj.weight": ((num_kv_heads * head_dim, hidden_size), 0.02),
            "self_attn.o_proj.weight": ((hidden_size, num_heads * head_dim), 0.02 * scale),
            "mlp.gate_proj.weight": ((intermediate_size, hidden_size), 0.02),
            "mlp.up_proj.weight": ((intermediate_size, hidden_size), 0.02),
            "mlp.down_proj.weight": ((hidden_size, intermediate_size), 0.02 * scale),
        }
        plan += [(pre + name, shape, std, key + j) for j, (name, (shape, std)) in enumerate(shapes.items())]
        plan += [(pre + "input_layernorm.weight", (hidden_size,), None, 0),
                 (pre + "post_attention_layernorm.weight", (hidden_size,), None, 0)]  # fmt: skip

    def draw(shape, std, key):
        if std is None:
            return torch.ones(shape, dtype=dtype)
        gen = torch.Generator(device=device).manual_seed(seed * 1_000_003 + key)
        return (torch.randn(shape, generator=gen, device=device, dtype=torch.float32) * std).to(dtype).cpu()

    element = torch.empty((), dtype=dtype).element_size()
    shards: list[list[tuple]] = [[]]
    size = 0
    for item in plan:
        nbytes = math.prod(item[1]) * element
        if shard_bytes is not None and shards[-1] and size + nbytes > shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(item)
        size += nbytes
    names = (["model.safetensors"] if shard_bytes is None else
             [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))])
    weight_map = {}
    for file, shard in zip(names, shards):
        tensors = {name: draw(shape, std, key) for name, shape, std, key in shard}
        save_file(tensors, os.path.join(path, file), metadata={"format": "pt"})
        del tensors
        weight_map.update({item[0]: file for item in shard})
    if shard_bytes is not None:
        total = sum(math.prod(item[1]) * element for item in plan)
        with open(os.path.join(path, "model.safetensors.index.json"), "w") as f:
            json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2)
    config = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": vocab_size,
        "hidden_size": hidden_size, "intermediate_size": intermediate_size, "num_hidden_layers": layers,
        "num_attention_heads": num_heads, "num_key_value_heads": num_kv_heads, "head_dim": head_dim,
        "max_position_embeddings": max_position_embeddings, "rms_norm_eps": 1e-5,
        "tie_word_embeddings": tie_word_embeddings,
        "rope_theta": 500000.0, "rope_scaling": None, "hidden_act": "silu", "bos_token_id": None,
        "eos_token_id": EOS_ID, "torch_dtype": str(dtype).removeprefix("torch."),
    }  # fmt: skip
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
    with open(os.path.join(path, "tokenizer.json"), "w") as f:
        f.write(byte_tokenizer_json())
    with open(os.path.join(path, "tokenizer_config.json"), "w") as f:
        json.dump({"chat_template": CHAT_TEMPLATE, "eos_token": EOS_TOKEN, "add_bos_token": False}, f)
    return path
