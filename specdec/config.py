"""EngineConfig: everything the engine needs, resolved and validated once (model folder, dtype, pool size)."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass

import torch

from specdec.cache.kv_pool import KVPool
from specdec.model.config import ModelConfig, resolve_dtype
from specdec.model.loader import resolve_model_path

DEVICES = ("cpu", "cuda", "auto")


@dataclass(slots=True)
class EngineConfig:
    model: str
    model_path: str
    model_config: ModelConfig
    dtype: torch.dtype
    device: torch.device
    max_model_len: int
    block_size: int
    max_num_seqs: int
    max_num_batched_tokens: int
    num_kv_blocks: int
    seed: int
    eos_token_ids: tuple[int, ...]

    @classmethod
    def create(
        cls,
        model: str,
        dtype: str | torch.dtype = "auto",
        device: str = "auto",
        max_model_len: int | None = None,
        block_size: int = 16,
        max_num_seqs: int = 64,
        max_num_batched_tokens: int | None = None,
        num_kv_blocks: int | None = None,
        kv_cache_memory_gb: float = 1.0,
        seed: int = 0,
        lookahead_slots: int = 0,
    ) -> EngineConfig:
        if device not in DEVICES:
            raise ValueError(f"device {device!r} is not supported; supported: {DEVICES}")
        if device == "cuda" and not torch.cuda.is_available():
            raise ValueError("device='cuda' was asked for, but torch sees no CUDA device; use 'cpu' or 'auto'")
        dev = torch.device("cuda" if device == "cuda" or (device == "auto" and torch.cuda.is_available()) else "cpu")
        if isinstance(dtype, str):
            resolve_dtype(dtype)  # validate the name before touching the model
        for name, value, low in (("block_size", block_size, 1), ("max_num_seqs", max_num_seqs, 1)):
            if not isinstance(value, int) or value < low:
                raise ValueError(f"{name} must be an integer >= {low}, got {value!r}")
        path = resolve_model_path(model)
        model_config = ModelConfig.from_json(path)
        torch_dtype = resolve_dtype(dtype, model_config)
        limit = model_config.max_position_embeddings
        if max_model_len is None:
            max_model_len = min(limit, 8192)
        if not isinstance(max_model_len, int) or not 1 <= max_model_len <= limit:
            raise ValueError(f"max_model_len must be an integer in [1, {limit}] (the model's "
                             f"max_position_embeddings), got {max_model_len!r}")
        # The pool must hold one full-length sequence (+ lookahead) so that a valid request never fails.
        min_blocks = -(-(max_model_len + lookahead_slots + 1) // block_size)
        if num_kv_blocks is None:
            per_block = KVPool.bytes_per_block(model_config, block_size, torch_dtype)
            num_kv_blocks = max(min_blocks, int(kv_cache_memory_gb * 2**30) // per_block)
        if not isinstance(num_kv_blocks, int) or num_kv_blocks < min_blocks:
            raise ValueError(f"num_kv_blocks={num_kv_blocks!r} cannot hold one sequence of max_model_len="
                             f"{max_model_len}; need at least {min_blocks} blocks of {block_size}")
        budget = max_num_batched_tokens if max_num_batched_tokens is not None else max(2048, max_model_len)
        return cls(model, path, model_config, torch_dtype, dev, max_model_len, block_size, max_num_seqs, budget,
                   num_kv_blocks, seed, eos_ids(path, model_config))


def eos_ids(path: str, config: ModelConfig) -> tuple[int, ...]:
    """Every eos id the model uses: config.json, generation_config.json and the tokenizer's eos token."""
    ids = set(config.eos_token_ids)
    gen = os.path.join(path, "generation_config.json")
    if os.path.isfile(gen):
        with open(gen, encoding="utf-8") as f:
            eos = json.load(f).get("eos_token_id")
        ids.update(eos if isinstance(eos, list) else [eos] if isinstance(eos, int) else [])
    return tuple(sorted(ids))


SPECULATIVE_METHODS = ("draft_model",)


@dataclass
class SpeculativeConfig:
    """How to speculate. ``LLM(model, speculative=None)`` is plain decoding.

    Args:
        method: "draft_model" (a smaller model of the same tokenizer proposes tokens).
        draft_model: the draft's folder / .gguf / hub id (method "draft_model").
        num_speculative_tokens: k, the most tokens drafted per round (>= 1).
        draft_dtype: the draft's dtype; None = the target's. Losslessness does not depend on it: the accept test
            uses exactly the q the draft sampled from.
    """

    method: str = "draft_model"
    draft_model: str | None = None
    num_speculative_tokens: int = 5
    draft_dtype: str | None = None

    def __post_init__(self) -> None:
        if self.method not in SPECULATIVE_METHODS:
            raise ValueError(f"speculative method {self.method!r} is not supported; supported: {SPECULATIVE_METHODS}")
        k = self.num_speculative_tokens
        if not isinstance(k, int) or isinstance(k, bool) or k < 1:
            raise ValueError(f"num_speculative_tokens must be an integer >= 1, got {k!r}")
        if self.method == "draft_model" and not self.draft_model:
            raise ValueError("method 'draft_model' needs draft_model (a folder, .gguf file or hub repo id)")
