"""An engine's tensor-parallel ranks: which models every rank shards, and how the other ranks start - spawned by
the engine (``launcher.py``), or already started by ``torchrun`` (``torchrun.py``; this process's environment
says which, ``launch_env.py``)."""

from __future__ import annotations

from specdec.checkpoint.loader import resolve_model_path
from specdec.config import (
    EngineConfig,
    SpeculativeConfig,
    check_draft_tensor_parallel,
    draft_model_dtype,
    gguf_source_of,
)
from specdec.distributed.driver_link import DriverLink
from specdec.distributed.launch_env import LaunchEnv
from specdec.distributed.launcher import TensorParallelWorkers
from specdec.distributed.sharding import check_quantized_tensor_parallel, check_tensor_parallel
from specdec.distributed.torchrun import TorchrunDriver, serve_as_worker
from specdec.distributed.worker import ModelSpec
from specdec.model.config import ModelConfig


def start_workers(config: EngineConfig, spec: SpeculativeConfig | None) -> DriverLink | None:
    """Rank 0's end of an engine with ``config.tensor_parallel_size > 1`` (None otherwise): ``shards[0]`` the
    target's (model, pool) on rank 0, ``shards[1]`` the draft's when it is sharded too. ``ValueError`` (nothing
    started) for a configuration tensor parallelism cannot run.

    Under ``torchrun`` on a rank other than 0 this does not return: the rank serves rank 0's engine, then ends the
    process (``torchrun.serve_as_worker``)."""
    size = config.tensor_parallel_size
    draft_size = check_draft_tensor_parallel(spec, size) if spec is not None else 1
    if size == 1:
        return None
    models = model_specs(config, spec, draft_size)
    env = LaunchEnv.from_environ()
    if env is None:
        return TensorParallelWorkers(size, config.device, config.distributed_timeout_s, models)
    if env.is_driver:
        return TorchrunDriver(env, env.device(config.device.type), config.distributed_timeout_s, models)
    serve_as_worker(env, config.device.type, config.distributed_timeout_s, models)


def model_specs(config: EngineConfig, spec: SpeculativeConfig | None, draft_size: int) -> list[ModelSpec]:
    """What every rank shards: the target, then the draft model when it is sharded too (``draft_size > 1``);
    ``ValueError`` if the draft cannot be."""
    models = [ModelSpec(config.model_path, config.model_config, config.dtype, config.max_model_len + 1,
                        config.num_kv_blocks, config.block_size, config.prepack_weights, config.quantization,
                        config.quantization_group_size, config.quantize_lm_head, config.gguf_source,
                        batch_invariant=config.batch_invariant)]
    if spec is not None and spec.uses_draft_model and draft_size > 1:
        models.append(_draft_spec(config, spec, draft_size))
    return models


def _draft_spec(config: EngineConfig, spec: SpeculativeConfig, size: int) -> ModelSpec:
    """The sharded draft's ``ModelSpec`` (as proposers/factory.py would load it in one process); a ``"self"``
    draft is the target's checkpoint sharing each rank's target embedding shard (model 0's)."""
    is_self = spec.draft_model == "self"
    path = config.model_path if is_self else resolve_model_path(spec.draft_model)
    draft_config = config.model_config if is_self else ModelConfig.from_json(path)
    check_tensor_parallel(draft_config, size, "draft model")
    check_quantized_tensor_parallel(draft_config, size, spec.draft_quantization, spec.draft_quantization_group_size,
                                    "draft model", "draft_quantization_group_size")
    dtype = draft_model_dtype(spec, draft_config, config)
    max_positions = min(draft_config.position_limit, config.max_model_len)  # as proposers/factory.py
    gguf = config.gguf_source if is_self else gguf_source_of(spec.draft_model, path)
    prepack = False if config.prepack_weights is False else None  # its dtype may not support prepacking
    return ModelSpec(path, draft_config, dtype, max_positions + 1, config.num_kv_blocks, config.block_size, prepack,
                     spec.draft_quantization, spec.draft_quantization_group_size, spec.draft_quantize_lm_head, gguf,
                     shares_embedding_of=0 if is_self else None,
                     batch_invariant=False if config.batch_invariant is False else None)  # its dtype may differ
