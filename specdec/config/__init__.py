"""Configuration, checked once before anything is loaded: the engine's (engine.py), speculative decoding's
(speculative.py; a vLLM ``speculative_config`` dict read by vllm_compat.py), static tree shapes (tree_shape.py), the KV
pool's size (kv_pool_sizing.py) and the tensor-parallel options (parallel.py)."""

from specdec.config.engine import DEVICES, EngineConfig, draft_model_dtype, eos_ids, gguf_source_of
from specdec.config.kv_pool_sizing import kv_pool_blocks, kv_pool_room
from specdec.config.parallel import check_draft_tensor_parallel, check_tensor_parallel_options
from specdec.config.speculative import (
    DRAFT_VOCAB_SUFFIXES,
    MODEL_FREE_LOOKUPS,
    RECYCLE_SCOPES,
    RENAMED_METHODS,
    SPECULATIVE_METHODS,
    SUFFIX_SCOPES,
    TREE_POLICIES,
    VERIFY_METHODS,
    SpeculativeConfig,
    check_draft_vocab_path,
)
from specdec.config.tree_shape import parse_tree, tree_size
from specdec.config.vllm_compat import speculative_config_from_dict

__all__ = [
    "DEVICES", "DRAFT_VOCAB_SUFFIXES", "MODEL_FREE_LOOKUPS", "RECYCLE_SCOPES", "RENAMED_METHODS", "SPECULATIVE_METHODS",
    "SUFFIX_SCOPES", "TREE_POLICIES",
    "VERIFY_METHODS", "EngineConfig", "SpeculativeConfig", "check_draft_tensor_parallel", "check_draft_vocab_path",
    "check_tensor_parallel_options", "draft_model_dtype", "eos_ids", "gguf_source_of", "kv_pool_blocks",
    "kv_pool_room", "parse_tree", "speculative_config_from_dict", "tree_size",
]
