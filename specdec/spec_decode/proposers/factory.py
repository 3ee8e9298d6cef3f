"""The one place a proposer is built from a ``SpeculativeConfig``: every option is passed at construction, nothing
is wired by setting attributes afterwards."""

from __future__ import annotations

from collections.abc import Callable

from torch import nn

from specdec.checkpoint.eagle3 import load_eagle3_head
from specdec.checkpoint.loader import load_model, read_checkpoint_tensor, resolve_model_path
from specdec.config import EngineConfig, SpeculativeConfig, draft_model_dtype, eos_ids, gguf_source_of
from specdec.distributed.layers import VocabParallelEmbedding
from specdec.model.config import ModelConfig, resolve_dtype
from specdec.model.eagle3 import Eagle3Config
from specdec.model.linear import prepack_linears, prepack_supported
from specdec.model.llama import LlamaForCausalLM
from specdec.model.subset_head import restrict_lm_head
from specdec.spec_decode.forward_timer import ForwardTimer
from specdec.spec_decode.proposers.base import ModelFreeProposer, Proposer
from specdec.spec_decode.proposers.combined import CombinedProposer
from specdec.spec_decode.proposers.compat import check_draft_compatible
from specdec.spec_decode.proposers.draft_model import DraftModelProposer
from specdec.spec_decode.proposers.draft_vocab import DraftVocab, read_draft_vocab
from specdec.spec_decode.proposers.eagle3 import Eagle3Proposer
from specdec.spec_decode.proposers.ngram_table import NgramTableProposer
from specdec.spec_decode.proposers.pick import build_pick
from specdec.spec_decode.proposers.prompt_lookup import PromptLookupProposer
from specdec.spec_decode.proposers.recycle import RecycleProposer
from specdec.spec_decode.proposers.suffix import SuffixProposer
from specdec.spec_decode.proposers.tree_drafting import TreeShape
from specdec.tokenizer.tokenizer import Tokenizer


def build_proposer(config: EngineConfig, spec: SpeculativeConfig, tokenizer: Tokenizer | None,
                   timer: ForwardTimer | None = None,
                   on_draft_forward: Callable[[int, float], None] | None = None,
                   target: LlamaForCausalLM | None = None, draft_shard: tuple | None = None) -> Proposer:
    """The proposer ``spec.method`` names: "draft_model", "prompt_lookup", "ngram_table", "recycle", "suffix",
    "pick", "combined" (a model-free lookup first, the draft model for the requests it has nothing for), or "eagle3" (an
    EAGLE-3 head).

    Args:
        config: the engine's config (the target model, pool sizes, device).
        tokenizer: the target's, to check a draft model's vocabulary against (None: the model folder has none).
        timer, on_draft_forward: adaptive k's draft timings (None when adaptive k is off).
        target: the loaded target model (an EAGLE-3 head without its own embedding shares the target's; a
            ``draft_model="self"`` draft shares its embedding, and its LM head when tied - except on rank 0 of a
            sharded target, where a draft on rank 0 alone reads its own full embedding).
        draft_shard: a tensor-parallel draft already loaded on every rank: rank 0's ``(model, pool)``
            (specdec/distributed/driver.py), used instead of loading the draft here.
    Raises ``ValueError`` when the draft model or head cannot draft for this target (proposers/compat.py,
    ``Eagle3Config.check_target``) or a head is not in the published EAGLE-3 layout.
    """
    if spec.method == "eagle3":
        return _load_eagle3(config, spec, target, timer, on_draft_forward)
    model = None
    if spec.uses_draft_model:
        model = _load_draft_model(config, spec, tokenizer, timer, on_draft_forward, target, draft_shard)
    if spec.method == "draft_model":
        return model
    lookup = _model_free(spec, spec.combined_lookup if spec.method == "combined" else spec.method,
                         config.model_config.vocab_size)
    return CombinedProposer(lookup, model) if spec.method == "combined" else lookup


def _model_free(spec: SpeculativeConfig, method: str, vocab_size: int) -> ModelFreeProposer:
    if method == "recycle":
        return RecycleProposer(vocab_size, spec.tree_max_branch, spec.recycle_scope)
    if method == "suffix":
        return SuffixProposer(spec.suffix_max_tokens, spec.suffix_scope)
    if method == "pick":
        return build_pick(vocab_size, (spec.prompt_lookup_min, spec.prompt_lookup_max),
                          (spec.ngram_min_order, spec.ngram_max_order, spec.ngram_window), spec.tree_max_branch,
                          spec.recycle_scope, spec.suffix_max_tokens, spec.suffix_scope)
    if method == "prompt_lookup":
        return PromptLookupProposer(spec.prompt_lookup_min, spec.prompt_lookup_max)
    return NgramTableProposer(spec.ngram_min_order, spec.ngram_max_order, spec.ngram_window)


def _tree_shape(spec: SpeculativeConfig) -> TreeShape | None:
    if not spec.uses_tree:
        return None
    return TreeShape(spec.tree if isinstance(spec.tree, list) else None, spec.tree_max_branch)


def _load_eagle3(config: EngineConfig, spec: SpeculativeConfig, target: LlamaForCausalLM | None,
                 timer: ForwardTimer | None, on_forward: Callable[[int, float], None] | None) -> Eagle3Proposer:
    if target is None:
        raise ValueError("method 'eagle3' needs the loaded target model (its embedding and hidden states)")
    path = resolve_model_path(spec.draft_model)
    dtype = config.dtype
    if spec.draft_dtype:
        dtype = resolve_dtype(spec.draft_dtype, Eagle3Config.from_json(path).layer, config.device)
    max_positions = config.max_model_len  # rotary tables: the head writes positions below max_model_len
    head = load_eagle3_head(path, dtype, config.device, max_positions + 1, config.model_config,
                            lambda: _embedding_for_head(config, target),
                            False if config.prepack_weights is False else None)
    aux_layers = head.config.aux_layers(config.model_config.num_hidden_layers)
    return Eagle3Proposer(head, aux_layers, config.num_kv_blocks, config.block_size, dtype, config.device,
                          max_positions, tree_shape=_tree_shape(spec),
                          noise_per_round=spec.verify == "block",  # fresh drafts every round (block_verify.py)
                          timer=timer, on_forward=on_forward)


def _embedding_for_head(config: EngineConfig, target: LlamaForCausalLM) -> nn.Embedding:
    """The embedding an EAGLE-3 head without its own shares: the target's; under tensor parallelism (a
    vocabulary-parallel embedding, whose lookup is a collective) a whole copy read from the target's checkpoint for
    the head on rank 0 - ``V * hidden`` elements more on rank 0 (docs/tensor_parallel.md)."""
    if not isinstance(target.embed_tokens, VocabParallelEmbedding):
        return target.embed_tokens
    weight = read_checkpoint_tensor(config.model_path, "model.embed_tokens.weight")  # (V, hidden)
    return nn.Embedding.from_pretrained(weight.to(config.device, config.dtype), freeze=True)


def _load_draft_model(config: EngineConfig, spec: SpeculativeConfig, tokenizer: Tokenizer | None,
                      timer: ForwardTimer | None, on_forward: Callable[[int, float], None] | None,
                      target_model: LlamaForCausalLM | None = None, shard: tuple | None = None
                      ) -> DraftModelProposer:
    is_self = spec.draft_model == "self"
    path = config.model_path if is_self else resolve_model_path(spec.draft_model)
    gguf_source = config.gguf_source if is_self else gguf_source_of(spec.draft_model, path)
    draft_config = config.model_config if is_self else ModelConfig.from_json(path)
    if not is_self:
        check_draft_compatible(config.model_config, draft_config, tokenizer, Tokenizer.from_dir(path),
                               config.eos_token_ids, eos_ids(path, draft_config))
    dtype = draft_model_dtype(spec, draft_config, config)
    shared = None
    # a target sharded over several ranks holds one vocabulary shard of the embedding here: a self draft on rank 0
    # alone (draft_tensor_parallel_size=1) reads the full embedding (V x hidden in its dtype) instead of sharing
    share = is_self and shard is None and target_model is not None and target_model.layout.size == 1
    if is_self:
        if target_model is None:
            raise ValueError("draft_model='self' needs the target model to share its embedding with")
        shared = target_model.embed_tokens.weight if share else None
    # the draft writes positions up to max_model_len - 1 at most, like the target
    max_positions = min(draft_config.position_limit, config.max_model_len)
    subset = (read_draft_vocab(spec.draft_vocab, spec.draft_vocab_size, config.model_config.vocab_size,
                               draft_config.vocab_size) if spec.draft_vocab is not None else None)
    if shard is not None:  # sharded over every rank (specdec/engine/tensor_parallel.py loaded it)
        assert subset is None, "a reduced draft vocabulary is refused for a sharded draft (check_draft_tensor_parallel)"
        model, pool = shard
        return DraftModelProposer(model, draft_config, config.num_kv_blocks, config.block_size, dtype, config.device,
                                  config.model_config.vocab_size, max_positions, tree_shape=_tree_shape(spec),
                                  noise_per_round=spec.verify == "block", timer=timer, on_forward=on_forward,
                                  pool=pool)
    # a reduced vocabulary cuts the plain head first: packing and quantising the head come after (_cut_head)
    model = load_model(path, dtype, config.device, max_positions + 1, draft_config,
                       False if config.prepack_weights is False or subset is not None else None,
                       spec.draft_quantization, spec.draft_quantization_group_size, gguf_source, shared,
                       quantize_lm_head=False if subset is not None else spec.draft_quantize_lm_head,
                       batch_invariant=False if config.batch_invariant is False else None)  # its dtype may differ
    if subset is not None:
        _cut_head(model, subset, spec, draft_config, dtype, config)
    elif share and draft_config.tie_word_embeddings and not spec.draft_quantize_lm_head:
        model.lm_head = target_model.lm_head  # the tied head is the embedding's rows (and their packed copy): share
    vocab = DraftVocab(subset, config.model_config.vocab_size, config.device) if subset is not None else None
    return DraftModelProposer(model, draft_config, config.num_kv_blocks, config.block_size, dtype, config.device,
                              config.model_config.vocab_size, max_positions, tree_shape=_tree_shape(spec),
                              noise_per_round=spec.verify == "block",  # fresh drafts every round (block_verify.py)
                              timer=timer, on_forward=on_forward, draft_vocab=vocab)


def _cut_head(model: LlamaForCausalLM, subset, spec: SpeculativeConfig, draft_config: ModelConfig, dtype,
              config: EngineConfig) -> None:
    """Cut the freshly loaded draft's plain LM head to the reduced vocabulary ``subset`` (int64 [S]), quantise the
    cut head where the full one would have been (``draft_quantize_lm_head``: None quantises an untied head), then
    prepack the model's plain linears as ``load_model`` would have."""
    # "gguf" holds a file's own blocks; a head cut to a subset of rows is dense (the converted rows in the dtype)
    quantize = spec.draft_quantization not in (None, "gguf") and (
        spec.draft_quantize_lm_head or (spec.draft_quantize_lm_head is None and not draft_config.tie_word_embeddings))
    restrict_lm_head(model, subset, spec.draft_quantization if quantize else None, spec.draft_quantization_group_size)
    if config.prepack_weights is not False and prepack_supported(dtype, config.device):
        prepack_linears(model)
