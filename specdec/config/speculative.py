"""SpeculativeConfig: how to speculate (the method, k, the drafter's options, trees, verification), checked once."""

from __future__ import annotations

import os
import warnings
from dataclasses import dataclass

from specdec.config.tree_shape import tree_size
from specdec.model.quant.linear import check_quantization, check_quantize_lm_head

SPECULATIVE_METHODS = ("draft_model", "ngram_table", "prompt_lookup", "recycle", "suffix", "pick", "combined",
                       "eagle3")
RECYCLE_SCOPES = ("engine", "request")
SUFFIX_SCOPES = ("tenant", "global")
MODEL_FREE_LOOKUPS = ("prompt_lookup", "ngram_table")
# old name -> new name; the old one still runs, with a DeprecationWarning (vLLM's "ngram" is our "prompt_lookup",
# so a copied vLLM config would otherwise run the other drafter without a word)
RENAMED_METHODS = {"ngram": "ngram_table"}
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
        method: "draft_model" (a smaller model of the same tokenizer drafts), "ngram_table" (frequency tables of
            the request's own tokens; "ngram" is its deprecated name, stored as "ngram_table" with a warning),
            "prompt_lookup" (copy what followed the latest earlier match of the text's suffix; vLLM calls this
            "ngram"), "recycle" (a tree of the target's own top-k candidates kept per token id from earlier
            forwards - Token Recycling; it drafts trees: ``tree=None`` means "dynamic" for it), "suffix" (what
            followed the text's suffix in the request and in earlier outputs of its tenant - SuffixDecoding),
            "pick" (each round, per request, the best of those four model-free drafters by their measured
            acceptance),
            "combined" (a model-free match when there is one, else the draft model), or "eagle3" (an EAGLE-3 head
            drafts from the target's own hidden states; docs/architecture.md, "EAGLE-3 heads").
        draft_model: the draft's folder / .gguf / hub id (methods "draft_model" and "combined"); "self": the
            target's own checkpoint loaded again as the draft (with ``draft_quantization``: a quantised copy of the
            target), sharing the target's tokenizer and embedding tensor; or the EAGLE-3 head's folder / hub id in
            the published ``LlamaForCausalLMEagle3`` layout (method "eagle3").
        num_speculative_tokens: k, the most tokens drafted per round (>= 1).
        draft_dtype: the draft's dtype; None = the target's. Losslessness does not depend on it: the accept test
            uses exactly the q the draft sampled from.
        draft_quantization / draft_quantization_group_size: quantise the draft's linears ("int8" per channel, "int4"
            per group of 32 by default; "gguf": a .gguf draft's own blocks; specdec/model/quant/), independently of
            the target's ``LLM(quantization=)``.
            Lossless either way: it only changes the proposals. ``draft_quantize_lm_head``: as
            ``LLM(quantize_lm_head=)`` for the draft (True: a tied draft head gets its own quantised copy; a self
            draft then stops sharing the target's head).
        ngram_min_order / ngram_max_order / ngram_window: n-gram orders (2..4 = contexts of 1..3 tokens) and the
            sliding window of tokens the tables describe.
        prompt_lookup_min / prompt_lookup_max: suffix lengths tried, longest first.
        combined_lookup: the model-free drafter "combined" tries first: "prompt_lookup" or "ngram_table"
            ("ngram": deprecated, as for ``method``).
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
        recycle_scope: method "recycle": "engine" - one candidate matrix for every request of the engine (what one
            request's forwards ranked drafts another's; outputs never depend on it, speed does), or "request" - a
            matrix per request, forgotten when it finishes.
        suffix_max_tokens: method "suffix": the most tokens of earlier outputs each index keeps (the oldest outputs
            are evicted first; ~100 bytes per token).
        suffix_scope: method "suffix": "tenant" - an index per tenant (``LLM.generate(tenant=)``; the API key under
            ``specdec serve``), so one tenant's text never shapes another's drafts or speed; "global" - one index for
            every request (opt-in sharing).
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
    recycle_scope: str = "engine"
    suffix_max_tokens: int = 200_000
    suffix_scope: str = "tenant"

    def __post_init__(self) -> None:
        self.method = _renamed("method", self.method)
        self.combined_lookup = _renamed("combined_lookup", self.combined_lookup)
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
        if self.recycle_scope not in RECYCLE_SCOPES:
            raise ValueError(f"recycle_scope {self.recycle_scope!r} is not supported; supported: {RECYCLE_SCOPES}")
        if self.recycle_scope != "engine" and self.method not in ("recycle", "pick"):
            raise ValueError(f"recycle_scope is for methods 'recycle' and 'pick', not {self.method!r}")
        if self.suffix_scope not in SUFFIX_SCOPES:
            raise ValueError(f"suffix_scope {self.suffix_scope!r} is not supported; supported: {SUFFIX_SCOPES}")
        size = self.suffix_max_tokens
        if not isinstance(size, int) or isinstance(size, bool) or size < 1:
            raise ValueError(f"suffix_max_tokens must be an integer >= 1 (tokens each tenant's index keeps), got "
                             f"{size!r}")
        if self.method not in ("suffix", "pick") and (self.suffix_scope != "tenant" or size != 200_000):
            raise ValueError(f"suffix_scope and suffix_max_tokens are for methods 'suffix' and 'pick', not "
                             f"{self.method!r}")
        if self.method == "recycle" and self.tree is None:
            self.tree = "dynamic"  # recycled candidates draft trees (tree_budget nodes, tree_max_branch per node)
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


def _renamed(field: str, value: object) -> object:
    """``value``'s current name, with a DeprecationWarning when it is an old one (``RENAMED_METHODS``)."""
    if not isinstance(value, str) or value not in RENAMED_METHODS:
        return value
    new = RENAMED_METHODS[value]
    # stacklevel: _renamed <- __post_init__ <- the dataclass's __init__ <- the caller's SpeculativeConfig(...)
    warnings.warn(f"SpeculativeConfig({field}={value!r}) is deprecated: our frequency-table drafter is now "
                  f"{new!r} ({field}={value!r} still runs it, as {new!r}). Note that vLLM's 'ngram' is our "
                  f"'prompt_lookup': for vLLM's behaviour use {field}='prompt_lookup'.",
                  DeprecationWarning, stacklevel=4)
    return new
