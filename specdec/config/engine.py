"""EngineConfig: everything the engine needs, resolved and validated once (model folder, dtype, pool size)."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field

import torch

from specdec.checkpoint.loader import resolve_model_path
from specdec.config.generation_defaults import GENERATION_CONFIG_MODES, sampling_defaults
from specdec.config.kv_pool_sizing import kv_pool_blocks
from specdec.config.parallel import check_tensor_parallel_options
from specdec.config.speculative import SpeculativeConfig
from specdec.distributed.sharding import check_quantized_tensor_parallel, check_tensor_parallel
from specdec.kernels.cpu.attention import supports_shape as invariant_attention_supports
from specdec.model.batch_invariant import check_option as check_batch_invariant_option
from specdec.model.config import ModelConfig, resolve_dtype
from specdec.model.linear import check_prepack_option
from specdec.model.quant.linear import check_quantization, check_quantize_lm_head

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
    prepack_weights: bool | None = None
    enable_prefix_caching: bool = True  # share cached full KV blocks of common prefixes (docs/architecture.md)
    # False: on CUDA uniform batches (decodes, draft steps, k+1 windows) replay CUDA graphs (LLMEngine.
    # enable_static_forward, specdec/runner/cuda_graphs.py); True: every forward eager. No effect on CPU
    # (docs/architecture.md, "CUDA graphs and the static forward").
    enforce_eager: bool = False
    quantization: str | None = None  # None | "int8" | "int4" | "gguf": the target's linears (specdec/model/quant/)
    quantization_group_size: int | None = None  # None: the scheme's default (int8 per channel, int4 32)
    # ranks the target is sharded over (docs/tensor_parallel.md); 1: one process, as before
    tensor_parallel_size: int = 1
    distributed_timeout_s: float = 60.0  # the most one collective waits for a worker (a hung one) before failing
    # None: an untied LM head is quantised with the linears, a tied one kept; True: a tied one too; False: never
    quantize_lm_head: bool | None = None
    # None: the row-invariant CPU kernels where they are not slower; True: wherever they run; False: never
    # (specdec/model/batch_invariant.py, docs/guarantees.md)
    batch_invariant: bool | None = None
    # SamplingParams field -> the model's default (generation_config.json, as vLLM reads it; {}: none)
    sampling_defaults: dict = field(default_factory=dict)

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
        prepack_weights: bool | None = None,
        enable_prefix_caching: bool = True,
        enforce_eager: bool = False,
        quantization: str | None = None,
        quantization_group_size: int | None = None,
        tensor_parallel_size: int = 1,
        distributed_timeout_s: float = 60.0,
        quantize_lm_head: bool | None = None,
        batch_invariant: bool | None = None,
        revision: str | None = None,
        generation_config: str = "auto",
    ) -> EngineConfig:
        if device not in DEVICES:
            raise ValueError(f"device {device!r} is not supported; supported: {DEVICES}")
        if device == "cuda" and not torch.cuda.is_available():
            raise ValueError("device='cuda' was asked for, but torch sees no CUDA device; use 'cpu' or 'auto'")
        dev = torch.device("cuda" if device == "cuda" or (device == "auto" and torch.cuda.is_available()) else "cpu")
        if isinstance(dtype, str):
            resolve_dtype(dtype)  # validate the name before touching the model
        for name, value, low in (("block_size", block_size, 1), ("max_num_seqs", max_num_seqs, 1)):
            if not isinstance(value, int) or isinstance(value, bool) or value < low:
                raise ValueError(f"{name} must be an integer >= {low}, got {value!r}")
        if not isinstance(enable_prefix_caching, bool):
            raise ValueError(f"enable_prefix_caching must be True or False, got {enable_prefix_caching!r}")
        if not isinstance(enforce_eager, bool):
            raise ValueError(f"enforce_eager must be True or False, got {enforce_eager!r}")
        check_quantization(quantization, quantization_group_size)
        check_quantize_lm_head(quantize_lm_head, quantization)
        check_tensor_parallel_options(tensor_parallel_size, distributed_timeout_s, dev)
        if generation_config not in GENERATION_CONFIG_MODES:  # before any download
            sampling_defaults("", generation_config)  # raises, naming the modes
        path = resolve_model_path(model, revision)
        model_config = ModelConfig.from_json(path)
        defaults = sampling_defaults(path, generation_config)
        check_tensor_parallel(model_config, tensor_parallel_size, "target")
        check_quantized_tensor_parallel(model_config, tensor_parallel_size, quantization, quantization_group_size,
                                        "target")
        torch_dtype = resolve_dtype(dtype, model_config, dev)
        check_prepack_option(prepack_weights, torch_dtype, dev)
        check_batch_invariant_option(batch_invariant, torch_dtype, dev)
        heads = (model_config.num_attention_heads // tensor_parallel_size,
                 model_config.num_key_value_heads // tensor_parallel_size)
        if batch_invariant and dev.type == "cpu" and not invariant_attention_supports(model_config.head_dim, *heads):
            raise ValueError(f"batch_invariant=True: the row-invariant attention takes a head dim that is a multiple "
                             f"of 16 up to 256 and at most 16 query heads per KV head; this model has head dim "
                             f"{model_config.head_dim}, {heads[0]} query and {heads[1]} KV heads per rank")
        limit = model_config.position_limit  # a sliding window: sequences are kept within it (ModelConfig)
        bound = "max_position_embeddings" if limit == model_config.max_position_embeddings else (
            "sliding_window: this model attends only its last positions, and longer sequences are not supported")
        if max_model_len is None:
            max_model_len = min(limit, 8192)
        if not isinstance(max_model_len, int) or not 1 <= max_model_len <= limit:
            raise ValueError(f"max_model_len must be an integer in [1, {limit}] (the model's {bound}), got "
                             f"{max_model_len!r}")
        # The pool must hold one full-length sequence (+ lookahead) so that a valid request never fails.
        min_blocks = -(-(max_model_len + lookahead_slots + 1) // block_size)
        if dev.type == "cuda" and not enforce_eager:
            min_blocks += 1  # the padding rows' scratch block of the CUDA graphs (engine/cuda_graphs.py)
        if num_kv_blocks is None:
            num_kv_blocks = max(min_blocks, kv_pool_blocks(model_config, block_size, torch_dtype, dev,
                                                           kv_cache_memory_gb, quantization, tensor_parallel_size))
        if not isinstance(num_kv_blocks, int) or num_kv_blocks < min_blocks:
            raise ValueError(f"num_kv_blocks={num_kv_blocks!r} cannot hold one sequence of max_model_len="
                             f"{max_model_len}; need at least {min_blocks} blocks of {block_size}")
        budget = max_num_batched_tokens if max_num_batched_tokens is not None else max(2048, max_model_len)
        if not isinstance(budget, int) or isinstance(budget, bool) or budget < 1:
            raise ValueError(f"max_num_batched_tokens must be an integer >= 1 (tokens computed per step; None = "
                             f"max(2048, max_model_len)), got {max_num_batched_tokens!r}")
        return cls(model, path, model_config, torch_dtype, dev, max_model_len, block_size, max_num_seqs, budget,
                   num_kv_blocks, seed, eos_ids(path, model_config), prepack_weights, enable_prefix_caching,
                   enforce_eager, quantization, quantization_group_size, tensor_parallel_size,
                   float(distributed_timeout_s), quantize_lm_head, batch_invariant, defaults)

    @property
    def gguf_source(self) -> str | None:
        """The .gguf file the model folder was converted from (its blocks can be kept quantised), or None: the
        file given as ``model``, or the default model's (its folder records the GGUF it was converted from)."""
        return gguf_source_of(self.model, self.model_path)


def draft_model_dtype(spec: SpeculativeConfig, draft_config: ModelConfig, config: EngineConfig) -> torch.dtype:
    """The draft model's dtype: ``spec.draft_dtype`` resolved, else the target's. ``ValueError`` for a
    ``draft_model="self"`` draft in another dtype than the target's: it shares the target's embedding."""
    dtype = resolve_dtype(spec.draft_dtype, draft_config, config.device) if spec.draft_dtype else config.dtype
    if spec.draft_model == "self" and dtype != config.dtype:
        raise ValueError(f"draft_model='self' shares the target's embedding, so draft_dtype must be the target's "
                         f"({config.dtype}), got {dtype}")
    return dtype


def gguf_source_of(model: str, model_path: str) -> str | None:
    """The GGUF behind ``model`` (as given) / ``model_path`` (resolved folder), or None (see EngineConfig)."""
    if isinstance(model, str) and model.endswith(".gguf"):
        return model
    from specdec.checkpoint.default_model import DEFAULT_MODEL_GGUF, default_gguf_path
    from specdec.checkpoint.gguf import read_conversion_record

    record = read_conversion_record(model_path)
    if record is None or record.get("source") != DEFAULT_MODEL_GGUF:
        return None
    try:
        return str(default_gguf_path())
    except (ModuleNotFoundError, FileNotFoundError):
        return None


def eos_ids(path: str, config: ModelConfig) -> tuple[int, ...]:
    """Every eos id the model uses: config.json, generation_config.json and the tokenizer's eos token."""
    ids = set(config.eos_token_ids)
    gen = os.path.join(path, "generation_config.json")
    if os.path.isfile(gen):
        with open(gen, encoding="utf-8") as f:
            eos = json.load(f).get("eos_token_id")
        ids.update(eos if isinstance(eos, list) else [eos] if isinstance(eos, int) else [])
    return tuple(sorted(ids))
