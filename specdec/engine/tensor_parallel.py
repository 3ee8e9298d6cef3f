"""An engine's tensor-parallel workers: which models every rank shards, started before the engine uses them."""

from __future__ import annotations

from specdec.config import EngineConfig, SpeculativeConfig, check_draft_tensor_parallel
from specdec.distributed.launcher import TensorParallelWorkers
from specdec.distributed.sharding import check_tensor_parallel
from specdec.distributed.worker import ModelSpec
from specdec.model.config import ModelConfig, resolve_dtype
from specdec.model.loader import resolve_model_path


def start_workers(config: EngineConfig, spec: SpeculativeConfig | None) -> TensorParallelWorkers | None:
    """The workers of an engine with ``config.tensor_parallel_size > 1`` (None otherwise): ``shards[0]`` the
    target's (model, pool) on rank 0, ``shards[1]`` the draft's when it is sharded too. ``ValueError`` (nothing
    started) for a configuration tensor parallelism cannot run."""
    size = config.tensor_parallel_size
    draft_size = check_draft_tensor_parallel(spec, size) if spec is not None else 1
    if size == 1:
        return None
    prepack = False if config.prepack_weights is False else None
    models = [ModelSpec(config.model_path, config.model_config, config.dtype, config.max_model_len + 1,
                        config.num_kv_blocks, config.block_size, config.prepack_weights)]
    if spec is not None and spec.uses_draft_model and draft_size > 1:
        path = resolve_model_path(spec.draft_model)
        draft_config = ModelConfig.from_json(path)
        check_tensor_parallel(draft_config, draft_size, "draft model")
        dtype = resolve_dtype(spec.draft_dtype, draft_config, config.device) if spec.draft_dtype else config.dtype
        max_positions = min(draft_config.max_position_embeddings, config.max_model_len)  # as proposers/factory.py
        models.append(ModelSpec(path, draft_config, dtype, max_positions + 1, config.num_kv_blocks,
                                config.block_size, prepack))
    return TensorParallelWorkers(size, config.device, config.distributed_timeout_s, models)
