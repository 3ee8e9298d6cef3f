"""EngineConfig: everything the engine needs, resolved and validated once (model folder, dtype, pool size)."""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass

import torch

from specdec.cache.kv_pool import KVPool
from specdec.checkpoint.loader import resolve_model_path
from specdec.distributed.launch_env import LaunchEnv, check_launch
from specdec.distributed.sharding import ShardLayout, check_quantized_tensor_parallel, check_tensor_parallel
from specdec.model.config import ModelConfig, resolve_dtype
from specdec.model.linear import available_memory_bytes, check_prepack_option
from specdec.model.quant.linear import check_quantization, check_quantize_lm_head

logger = logging.getLogger(__name__)

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
    quantization: str | None = None  # None | "int8" | "int4": the target's linears (specdec/model/quant/)
    quantization_group_size: int | None = None  # None: the scheme's default (int8 per channel, int4 32)
    # ranks the target is sharded over (docs/tensor_parallel.md); 1: one process, as before
    tensor_parallel_size: int = 1
    distributed_timeout_s: float = 60.0  # the most one collective waits for a worker (a hung one) before failing
    # None: an untied LM head is quantised with the linears, a tied one kept; True: a tied one too; False: never
    quantize_lm_head: bool | None = None

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
        _check_tensor_parallel_options(tensor_parallel_size, distributed_timeout_s, dev)
        path = resolve_model_path(model)
        model_config = ModelConfig.from_json(path)
        check_tensor_parallel(model_config, tensor_parallel_size, "target")
        check_quantized_tensor_parallel(model_config, tensor_parallel_size, quantization, quantization_group_size,
                                        "target")
        torch_dtype = resolve_dtype(dtype, model_config, dev)
        check_prepack_option(prepack_weights, torch_dtype, dev)
        limit = model_config.max_position_embeddings
        if max_model_len is None:
            max_model_len = min(limit, 8192)
        if not isinstance(max_model_len, int) or not 1 <= max_model_len <= limit:
            raise ValueError(f"max_model_len must be an integer in [1, {limit}] (the model's "
                             f"max_position_embeddings), got {max_model_len!r}")
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
                   float(distributed_timeout_s), quantize_lm_head)

    @property
    def gguf_source(self) -> str | None:
        """The .gguf file the model folder was converted from (its blocks can be kept quantised), or None: the
        file given as ``model``, or the default model's (its folder records the GGUF it was converted from)."""
        return gguf_source_of(self.model, self.model_path)


def _check_tensor_parallel_options(size: object, timeout_s: object, device: torch.device) -> None:
    if not isinstance(size, int) or isinstance(size, bool) or size < 1:
        raise ValueError(f"tensor_parallel_size must be an integer >= 1, got {size!r}")
    if not isinstance(timeout_s, (int, float)) or isinstance(timeout_s, bool) or not timeout_s > 0:
        raise ValueError(f"distributed_timeout_s must be a number of seconds > 0, got {timeout_s!r}")
    check_launch(size, device)  # under torchrun: size == WORLD_SIZE, a CUDA device per local rank
    if size == 1:
        return
    if device.type == "cuda" and LaunchEnv.from_environ() is None and size > torch.cuda.device_count():
        raise ValueError(f"tensor_parallel_size={size} needs {size} CUDA devices (one per rank), but torch sees "
                         f"{torch.cuda.device_count()}; allowed: 1..{torch.cuda.device_count()}")


def check_draft_tensor_parallel(spec: SpeculativeConfig, size: int) -> int:
    """The draft's tensor-parallel size under a target sharded over ``size`` ranks (``spec``'s
    ``draft_tensor_parallel_size``; None: the target's, for a draft model), or ``ValueError`` saying what is
    allowed."""
    draft = spec.draft_tensor_parallel_size
    if draft is None:
        draft = size if spec.uses_draft_model else 1
    if draft not in (1, size):
        raise ValueError(f"draft_tensor_parallel_size must be 1 (the draft on rank 0 only) or the target's "
                         f"tensor_parallel_size ({size}), got {draft}")
    if draft > 1 and spec.draft_vocab is not None:
        raise ValueError(f"draft_vocab (a reduced draft LM head) needs the draft on rank 0 only: set "
                         f"draft_tensor_parallel_size=1 (got {draft}, the target's tensor_parallel_size by default)")
    if draft > 1 and spec.method == "eagle3":
        raise ValueError("an EAGLE-3 head (one decoder layer) runs on rank 0 only: draft_tensor_parallel_size must "
                         f"be None or 1 with method 'eagle3', got {draft}")
    return draft


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


def kv_pool_blocks(model_config: ModelConfig, block_size: int, dtype: torch.dtype, device: torch.device,
                   kv_cache_memory_gb: float, quantization: str | None = None, tensor_parallel_size: int = 1) -> int:
    """Blocks that ``kv_cache_memory_gb`` buys per rank (before the one-sequence minimum): the budget over one
    block of *this rank's* kv heads (``ShardLayout.num_kv_heads``: ``Hkv / N``, or the one replicated head when
    ``N > Hkv``; every rank holds as many heads, so every rank gets the same count, as the driver's block tables
    need). On CPU the budget is capped at ``kv_pool_room`` shared by the N ranks (they share the host's memory);
    on CUDA each rank's GPU has its own."""
    heads = ShardLayout.of(model_config, 0, tensor_parallel_size).num_kv_heads
    per_block = KVPool.bytes_per_block(model_config, block_size, dtype, heads)
    pool_bytes = int(kv_cache_memory_gb * 2**30)
    room = kv_pool_room(model_config, dtype, device, quantization)
    if device.type == "cpu":
        room //= tensor_parallel_size
    if room < pool_bytes:
        logger.warning("the KV pool is capped at %.2f GB per rank (kv_cache_memory_gb=%s): half of the memory the "
                       "weights leave available, over %d rank(s)", room / 1e9, kv_cache_memory_gb,
                       tensor_parallel_size)
        pool_bytes = room
    return pool_bytes // per_block


def kv_pool_room(model_config: ModelConfig, dtype: torch.dtype, device: torch.device,
                 quantization: str | None = None) -> int:
    """Bytes the KV pool may take on CPU: half of what the memory available now (``MemAvailable``) leaves once the
    weights are loaded (their bytes in ``dtype``), so that ``kv_cache_memory_gb`` never pushes a model that fits
    into swap or the OOM killer. Unbounded on CUDA (the pool is sized in GiB there) or where it is not known."""
    available = available_memory_bytes() if device.type == "cpu" else None
    if available is None:
        return 2**62
    per_param = {"int8": 1.0, "int4": 0.75}.get(quantization, torch.empty((), dtype=dtype).element_size())
    weights = int(model_config.num_params * per_param)  # quantised: ~ the linears' bytes (a bound, not exact)
    return max(0, (available - weights) // 2)


def eos_ids(path: str, config: ModelConfig) -> tuple[int, ...]:
    """Every eos id the model uses: config.json, generation_config.json and the tokenizer's eos token."""
    ids = set(config.eos_token_ids)
    gen = os.path.join(path, "generation_config.json")
    if os.path.isfile(gen):
        with open(gen, encoding="utf-8") as f:
            eos = json.load(f).get("eos_token_id")
        ids.update(eos if isinstance(eos, list) else [eos] if isinstance(eos, int) else [])
    return tuple(sorted(ids))


def tree_size(branching: list[int]) -> int:
    """Drafted nodes of a static tree where every node at depth d has ``branching[d]`` children."""
    total, width = 0, 1
    for b in branching:
        width *= b
        total += width
    return total


def parse_tree(text: str | None) -> list[int] | str | None:
    """A ``--tree`` option: ``"3,2,1,1"`` -> ``[3, 2, 1, 1]``, ``"dynamic"``, or None / ``""`` / ``"none"``."""
    if text is None or text.strip().lower() in ("", "none", "chain"):
        return None
    if text.strip().lower() == "dynamic":
        return "dynamic"
    try:
        return [int(part) for part in text.split(",")]
    except ValueError:
        raise ValueError(f"--tree must be 'dynamic' or comma-separated branching factors like 3,2,1,1; got {text!r}"
                         ) from None


SPECULATIVE_METHODS = ("draft_model", "ngram", "prompt_lookup", "combined", "eagle3")
MODEL_FREE_LOOKUPS = ("prompt_lookup", "ngram")
VERIFY_METHODS = ("token", "block")
TREE_POLICIES = ("measured", "always")


DRAFT_VOCAB_SUFFIXES = (".json", ".safetensors", ".pt")  # the files SpeculativeConfig(draft_vocab=) reads


def check_draft_vocab_path(path: object) -> None:
    """``ValueError`` unless ``path`` names an existing file of a supported kind (before any model is loaded)."""
    if not isinstance(path, (str, os.PathLike)) or not str(path):
        raise ValueError(f"draft_vocab must be the path of a file of target token ids, got {path!r}")
    if not str(path).endswith(DRAFT_VOCAB_SUFFIXES):
        raise ValueError(f"draft_vocab {str(path)!r}: expected a {' / '.join(DRAFT_VOCAB_SUFFIXES)} file (a JSON "
                         "list of token ids as `specdec draft-vocab` writes, or an EAGLE-3 d2t / t2d map)")
    if not os.path.isfile(path):
        raise ValueError(f"draft_vocab file {str(path)!r} does not exist (build one with `specdec draft-vocab`)")


@dataclass
class SpeculativeConfig:
    """How to speculate. ``LLM(model, speculative=None)`` is plain decoding.

    Args:
        method: "draft_model" (a smaller model of the same tokenizer drafts), "ngram" (frequency tables of the
            request's own tokens), "prompt_lookup" (copy what followed the latest earlier match of the text's
            suffix; vLLM calls this "ngram"), "combined" (a model-free match when there is one, else the draft
            model), or "eagle3" (an EAGLE-3 head drafts from the target's own hidden states; docs/architecture.md,
            "EAGLE-3 heads").
        draft_model: the draft's folder / .gguf / hub id (methods "draft_model" and "combined"); "self": the
            target's own checkpoint loaded again as the draft (with ``draft_quantization``: a quantised copy of the
            target), sharing the target's tokenizer and embedding tensor; or the EAGLE-3 head's folder / hub id in
            the published ``LlamaForCausalLMEagle3`` layout (method "eagle3").
        num_speculative_tokens: k, the most tokens drafted per round (>= 1).
        draft_dtype: the draft's dtype; None = the target's. Losslessness does not depend on it: the accept test
            uses exactly the q the draft sampled from.
        draft_quantization / draft_quantization_group_size: quantise the draft's linears ("int8" per channel, "int4"
            per group of 32 by default; specdec/model/quant/), independently of the target's ``LLM(quantization=)``.
            Lossless either way: it only changes the proposals. ``draft_quantize_lm_head``: as
            ``LLM(quantize_lm_head=)`` for the draft (True: a tied draft head gets its own quantised copy; a self
            draft then stops sharing the target's head).
        ngram_min_order / ngram_max_order / ngram_window: n-gram orders (2..4 = contexts of 1..3 tokens) and the
            sliding window of tokens the tables describe.
        prompt_lookup_min / prompt_lookup_max: suffix lengths tried, longest first.
        combined_lookup: the model-free drafter "combined" tries first: "prompt_lookup" or "ngram".
        adaptive: choose k per request in [0, k] from its online acceptance and the measured costs; k = 0
            switches speculation off for the request (with occasional probes).
        cost_model: inject the costs adaptive k uses (see specdec.spec_decode.adaptive); None = measured.
        verify: how sampled chains are verified: "token" (accept each draft with min(1, p/q) until the first
            rejection) or "block" (Sun et al. 2025: the block jointly; never fewer accepted tokens in expectation,
            lossless; kernels/block_verify.py). Greedy rows and model-free (one-hot) drafts are verified token-wise
            either way (block gains nothing there).
        tree: draft a token tree instead of a chain. A list of branching factors per depth, e.g. ``[3, 2, 1, 1]``
            (every node at depth d gets ``tree[d]`` children: 3 + 6 + 6 + 6 = 21 nodes), or ``"dynamic"``: a
            best-first tree under ``tree_budget`` nodes, each node branching into at most ``tree_max_branch``
            children, expanded where the draft is most confident (EAGLE-2 style). The depth is capped by
            ``num_speculative_tokens``. Model-free drafters build a trie of several earlier matches under the
            same node budget. None (default): chains.
        tree_budget: the most drafted nodes of a dynamic tree (and of a model-free trie with ``"dynamic"``).
        tree_max_branch: the most children of one node in a dynamic tree.
        tree_max_batch_size: trees are drafted only while at most this many requests run; a larger batch drafts
            chains (on a GPU a tree is nearly free at batch 1 and costly at large batch; docs/benchmarks.md).
        tree_policy: with ``tree`` set, "measured" (default): each round drafts the tree or the chain, whichever its
            measured yield and costs value more (specdec/spec_decode/adaptive.py), so a tree is drafted only where
            it pays - with ``adaptive=True`` the depth adapts too (and a plain step is a candidate); "always": a tree
            every round while the batch is small enough (the depth is k_eff; not with ``adaptive=True``).
        draft_tensor_parallel_size: under ``LLM(tensor_parallel_size=N)``, the draft model sharded over the same N
            ranks (N; the default for a draft model) or run on rank 0 only (1); anything else is refused
            (docs/tensor_parallel.md). Quantised drafts and ``draft_model="self"`` shard too: each rank's self
            draft shares that rank's target embedding shard; a self draft on rank 0 only loads the full embedding
            there (it cannot share a shard).
    """

    method: str = "draft_model"
    draft_model: str | None = None
    num_speculative_tokens: int = 5
    draft_dtype: str | None = None
    ngram_min_order: int = 2
    ngram_max_order: int = 4
    ngram_window: int = 512
    prompt_lookup_min: int = 2
    prompt_lookup_max: int = 4
    combined_lookup: str = "prompt_lookup"
    adaptive: bool = False
    cost_model: object | None = None
    verify: str = "token"
    tree: list[int] | str | None = None
    tree_budget: int = 16
    tree_max_branch: int = 4
    tree_max_batch_size: int = 4
    tree_policy: str = "measured"
    draft_quantization: str | None = None
    draft_quantization_group_size: int | None = None
    draft_quantize_lm_head: bool | None = None
    draft_tensor_parallel_size: int | None = None
    draft_vocab: str | None = None
    draft_vocab_size: int | None = None

    def __post_init__(self) -> None:
        if self.method not in SPECULATIVE_METHODS:
            raise ValueError(f"speculative method {self.method!r} is not supported; supported: {SPECULATIVE_METHODS}")
        k = self.num_speculative_tokens
        if not isinstance(k, int) or isinstance(k, bool) or k < 1:
            raise ValueError(f"num_speculative_tokens must be an integer >= 1, got {k!r}")
        uses_model = self.method in ("draft_model", "combined", "eagle3")
        if uses_model and not self.draft_model:
            raise ValueError(f"method {self.method!r} needs draft_model (a folder, .gguf file or hub repo id"
                             f"{'; for eagle3 the head' if self.method == 'eagle3' else ''})")
        if not uses_model and self.draft_model:
            raise ValueError(f"method {self.method!r} uses no draft model; drop draft_model or use 'combined'")
        if not 2 <= self.ngram_min_order <= self.ngram_max_order:
            raise ValueError(f"n-gram orders must satisfy 2 <= ngram_min_order <= ngram_max_order, got "
                             f"{self.ngram_min_order}, {self.ngram_max_order}")
        if self.ngram_window < self.ngram_max_order:
            raise ValueError(f"ngram_window ({self.ngram_window}) must be >= ngram_max_order ({self.ngram_max_order})")
        if not 1 <= self.prompt_lookup_min <= self.prompt_lookup_max:
            raise ValueError(f"prompt lookup lengths must satisfy 1 <= prompt_lookup_min <= prompt_lookup_max, got "
                             f"{self.prompt_lookup_min}, {self.prompt_lookup_max}")
        if self.combined_lookup not in MODEL_FREE_LOOKUPS:
            raise ValueError(f"combined_lookup {self.combined_lookup!r} is not supported; supported: "
                             f"{MODEL_FREE_LOOKUPS}")
        if self.cost_model is not None and not self.adaptive and not (self.tree is not None and
                                                                       self.tree_policy == "measured"):
            raise ValueError("cost_model is only used with adaptive=True or a tree with tree_policy='measured'")
        check_quantization(self.draft_quantization, self.draft_quantization_group_size, "draft_quantization")
        check_quantize_lm_head(self.draft_quantize_lm_head, self.draft_quantization, "draft_quantize_lm_head")
        if self.draft_quantization is not None and not uses_model:
            raise ValueError(f"draft_quantization needs a draft model (method 'draft_model' or 'combined'), not "
                             f"{self.method!r}")
        dtp = self.draft_tensor_parallel_size
        if dtp is not None and (not isinstance(dtp, int) or isinstance(dtp, bool) or dtp < 1):
            raise ValueError(f"draft_tensor_parallel_size must be None (the target's), 1 or the target's "
                             f"tensor_parallel_size, got {dtp!r}")
        if self.verify not in VERIFY_METHODS:
            raise ValueError(f"verify {self.verify!r} is not supported; supported: {VERIFY_METHODS}")
        self._check_draft_vocab()
        self._check_tree()

    def _check_draft_vocab(self) -> None:
        size = self.draft_vocab_size
        if size is not None and (not isinstance(size, int) or isinstance(size, bool) or size < 1):
            raise ValueError(f"draft_vocab_size must be None (every id of draft_vocab) or an integer >= 1, "
                             f"got {size!r}")
        if self.draft_vocab is None:
            if size is not None:
                raise ValueError("draft_vocab_size needs draft_vocab: the ranked file of token ids to take the first "
                                 f"{size} of (build one with `specdec draft-vocab`)")
            return
        if self.method == "eagle3":
            raise ValueError("draft_vocab is for draft models: an EAGLE-3 head carries its own reduced vocabulary "
                             "(d2t in its checkpoint)")
        if not self.uses_draft_model:
            raise ValueError(f"draft_vocab needs a draft model (method 'draft_model' or 'combined'); method "
                             f"{self.method!r} has no LM head to cut")
        check_draft_vocab_path(self.draft_vocab)

    def _check_tree(self) -> None:
        for name in ("tree_budget", "tree_max_branch", "tree_max_batch_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
        if self.tree_policy not in TREE_POLICIES:
            raise ValueError(f"tree_policy {self.tree_policy!r} is not supported; supported: {TREE_POLICIES}")
        tree = self.tree
        if tree is not None and self.adaptive and self.tree_policy == "always":
            raise ValueError("tree_policy='always' drafts a tree every round; adaptive=True needs "
                             "tree_policy='measured' (which chooses tree, chain or a plain step per round)")
        if tree is None or tree == "dynamic":
            return
        if isinstance(tree, tuple):
            tree = self.tree = list(tree)
        if (not isinstance(tree, list) or not tree
                or any(not isinstance(b, int) or isinstance(b, bool) or b < 1 for b in tree)):
            raise ValueError(f"tree must be None, 'dynamic' or a non-empty list of branching factors >= 1 per depth "
                             f"(e.g. [3, 2, 1, 1]), got {tree!r}")
        if tree_size(tree) > 256:
            raise ValueError(f"tree {tree} has {tree_size(tree)} nodes; at most 256 are supported")

    @property
    def uses_tree(self) -> bool:
        return self.tree is not None

    def tree_nodes(self, depth: int) -> int:
        """Drafted nodes of this config's tree cut at ``depth`` (the slots a tree round needs)."""
        if self.tree is None:
            return depth
        if self.tree == "dynamic":
            return min(self.tree_budget, tree_size([self.tree_max_branch] * depth)) if depth > 0 else 0
        return tree_size(self.tree[:depth])

    @property
    def measures_trees(self) -> bool:
        """Rounds choose tree or chain (and, with adaptive k, the depth) from measured costs."""
        return self.tree is not None and self.tree_policy == "measured"

    @property
    def uses_draft_model(self) -> bool:
        """A standalone draft model drafts (methods "draft_model" and "combined")."""
        return self.method in ("draft_model", "combined")

    @property
    def drafts_with_a_model(self) -> bool:
        """Drafting runs a model forward: a draft model or an EAGLE-3 head (not a model-free lookup)."""
        return self.uses_draft_model or self.method == "eagle3"

    @property
    def reads_target_hidden_states(self) -> bool:
        """The proposer is fed the target's hidden states (EAGLE-3): the target's forward captures them and
        its prefix cache is off (a cached prefix has no hidden states to feed the head)."""
        return self.method == "eagle3"
