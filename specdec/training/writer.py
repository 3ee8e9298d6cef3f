"""Write a trained head in the published EAGLE-3 layout (``LlamaForCausalLMEagle3``), which vLLM, SGLang,
SpecForge and ``specdec`` load: ``config.json`` and ``model.safetensors`` (``specdec/model/eagle3.py`` documents
the layout)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch
from safetensors.torch import save_file

from specdec.checkpoint.eagle3 import check_layout
from specdec.model.eagle3 import Eagle3Config

# rope and norm settings copied from the target's config.json (either dialect), so the head rotates as it does
_COPIED_KEYS = ("rms_norm_eps", "rope_theta", "rope_scaling", "rope_parameters", "max_position_embeddings",
                "bos_token_id", "eos_token_id")


def head_config_dict(target_config: dict, draft_vocab_size: int, aux_layer_ids: tuple[int, ...]) -> dict:
    """The head's ``config.json``: the target's shapes (one layer, no biases), rope and norm settings, plus
    ``draft_vocab_size``, ``target_hidden_size`` and ``eagle_config.eagle_aux_hidden_state_layer_ids`` (vLLM's
    numbering: id k is the hidden state entering target layer k)."""
    t = target_config
    num_heads = t["num_attention_heads"]
    raw = {
        "architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama", "hidden_act": "silu",
        "hidden_size": t["hidden_size"], "intermediate_size": t["intermediate_size"], "num_hidden_layers": 1,
        "num_attention_heads": num_heads, "num_key_value_heads": t.get("num_key_value_heads") or num_heads,
        "head_dim": t.get("head_dim") or t["hidden_size"] // num_heads, "attention_bias": False,
        "tie_word_embeddings": False, "torch_dtype": "float32", "vocab_size": t["vocab_size"],
        "draft_vocab_size": draft_vocab_size, "target_hidden_size": t["hidden_size"],
        "norm_before_residual": False,
        "eagle_config": {"eagle_aux_hidden_state_layer_ids": list(aux_layer_ids), "use_aux_hidden_state": True},
    }
    raw |= {k: t[k] for k in _COPIED_KEYS if k in t}
    return raw


def write_head(out_dir: str | os.PathLike, config_dict: dict, tensors: dict[str, torch.Tensor],
               d2t: torch.Tensor, t2d: torch.Tensor) -> None:
    """Write ``config.json`` and ``model.safetensors`` (``tensors`` under published names, plus ``d2t`` int64
    ``[D]`` and ``t2d`` bool ``[V]``) into ``out_dir``, after checking them against the published layout."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    all_tensors = {**tensors, "d2t": d2t.to(torch.int64).contiguous(), "t2d": t2d.to(torch.bool).contiguous()}
    config = Eagle3Config.from_dict(config_dict, source="the trained head's config")
    check_layout(all_tensors, config, "the trained head")
    tmp = out_dir / "model.safetensors.tmp"
    save_file(all_tensors, str(tmp), metadata={"format": "pt"})
    os.replace(tmp, out_dir / "model.safetensors")
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(out_dir / "model.safetensors", 0o666 & ~umask)  # NOTE: safetensors creates its file owner-only
    with open(out_dir / "config.json", "w", encoding="utf-8") as f:
        json.dump(config_dict, f, indent=2)
