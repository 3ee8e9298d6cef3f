"""Helpers shared by the engine tests: a small-pool LLM, a token-exact greedy comparison, a layer-skip draft."""

import json
import os

import torch

import specdec

# The tests' KV pool: 1/16 of LLM's default kv_cache_memory_gb (1.0). The tiny models' 512 bytes per token buy
# 131k tokens with it - far more than any test fills - while the default pool costs ~1 GiB of RSS per engine.
SMALL_KV_POOL_GB = 1 / 16


def small_llm(model: str, **kwargs) -> specdec.LLM:
    """``specdec.LLM(model, **kwargs)`` with a ``SMALL_KV_POOL_GB`` pool unless ``num_kv_blocks`` or
    ``kv_cache_memory_gb`` is given (tests of the pool's sizing pass their own)."""
    if "num_kv_blocks" not in kwargs:
        kwargs.setdefault("kv_cache_memory_gb", SMALL_KV_POOL_GB)
    return specdec.LLM(model, **kwargs)


def assert_greedy_equal(got: list[int], expected: list[int], oracle_logits_fn=None, context: str = ""):
    """Token-exact greedy comparison. On divergence, report the oracle's top-2 logit gap at that position:
    a gap < 1e-4 is a numerical tie (accepted); anything else fails."""
    if got == expected:
        return
    n = next((i for i, (a, b) in enumerate(zip(got, expected)) if a != b), min(len(got), len(expected)))
    if oracle_logits_fn is None:
        raise AssertionError(f"{context}: greedy tokens diverge at {n}: {got} vs {expected}")
    logits = oracle_logits_fn(expected[:n])  # logits [V] for the position where they diverge
    top2 = torch.topk(logits.float(), 2).values
    gap = float(top2[0] - top2[1])
    assert gap < 1e-4, f"{context}: greedy tokens diverge at {n} with oracle top-2 gap {gap:.3g}: {got} vs {expected}"


def make_layer_skip_draft(src: str, dst: str, num_layers: int) -> str:
    """The target's first ``num_layers`` layers + its final norm and LM head, written as a real checkpoint."""
    from safetensors.torch import load_file, save_file

    os.makedirs(dst, exist_ok=True)
    cfg = json.loads(open(os.path.join(src, "config.json")).read())
    cfg["num_hidden_layers"] = num_layers
    with open(os.path.join(dst, "config.json"), "w") as f:
        json.dump(cfg, f)
    tensors = {}
    for file in sorted(f for f in os.listdir(src) if f.endswith(".safetensors")):
        for name, t in load_file(os.path.join(src, file)).items():
            if name.startswith("model.layers.") and int(name.split(".")[2]) >= num_layers:
                continue
            tensors[name] = t
    save_file(tensors, os.path.join(dst, "model.safetensors"))
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        if os.path.exists(os.path.join(src, name)):
            with open(os.path.join(src, name)) as f, open(os.path.join(dst, name), "w") as g:
                g.write(f.read())
    return dst
