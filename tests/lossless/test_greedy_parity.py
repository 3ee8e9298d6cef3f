"""Greedy speculative decoding emits the plain greedy tokens, token for token, in float32 on CPU - one parametrised
matrix over the speculative configurations (docs/guarantees.md, "Greedy").

Every case builds ``specdec.LLM`` with one speculative configuration, generates a prompt set greedily and compares
with the plain (target-only) LLM of the same target on the same prompts. Besides the tokens, every case checks that
drafts were accepted (the drafter really drafted), that rounds were also rejected unless the case says otherwise (so
the rollback path ran), and that every block pool is whole afterwards; a case may add its own checks.

Axes: the draft model at k = 1..8, block verification, static and dynamic draft-model trees, prompt lookup and the
n-gram table (chains and trees), recycled candidates, suffix drafting and the per-round pick among them (trees,
chains, per-request matrices, tenants), combined drafting, adaptive k, EAGLE-3 heads (chains, trees, a smaller head
vocabulary, block verification, adaptive k), reduced draft vocabularies (``draft_vocab=``), quantised targets and
quantised self drafts, greedy requests with penalties, structured outputs (a regex and a JSON schema: chains, block
verification, trees, model-free drafters, EAGLE-3), batch 1 and 4, and steps that mix prefill chunks, plain rows and
rounds (a small token budget, requests near ``max_tokens``).
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass, field

import pytest
import torch
from eagle3_helpers import DRAFT_IDS, HEAD_HEADS, HEAD_MLP, LAYERS
from helpers import small_llm
from tiny_models import make_tiny_eagle3_head, make_tiny_model

from specdec import SamplingParams, SpeculativeConfig
from specdec.model import batch_invariant
from specdec.model.quant.linear import QuantizedLinear

VOCAB = 300  # tiny_models' default, both targets
SUBSET = [t for t in range(VOCAB) if t % 3]  # a reduced draft vocabulary: every id not divisible by 3


def random_prompts(n, seed, lo=3, hi=40):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 257, (int(torch.randint(lo, hi, (1,), generator=gen)),), generator=gen).tolist()
            for _ in range(n)]


def repetitive_prompts(n, seed):
    """Each prompt a random unit repeated 4 times: prompt lookup and the n-gram table find something to match."""
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 257, (int(torch.randint(3, 9, (1,), generator=gen)),), generator=gen).tolist() * 4
            for _ in range(n)]


def greedy(max_tokens, **penalties):
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, **penalties)


INTEGERS = {"type": "array", "items": {"type": "integer"}, "minItems": 30}  # >= 60 tokens of JSON

# name -> (prompts, sampling params per prompt)
PROMPT_SETS = {
    "random": (random_prompts(6, seed=1), [greedy(24)] * 6),
    "repetitive": (repetitive_prompts(6, seed=2), [greedy(32)] * 6),
    # long prompts chunked by a 24-token budget into steps shared with rounds; requests near max_tokens take plain
    # steps in those same steps (pair it with max_num_batched_tokens=24)
    "mixed": (random_prompts(3, seed=7, lo=3, hi=8) + random_prompts(2, seed=8, lo=60, hi=90),
              [greedy(m) for m in (24, 2, 17, 24, 9)]),
    "penalties": (random_prompts(6, seed=3),
                  [greedy(24, repetition_penalty=1.3, presence_penalty=0.4, frequency_penalty=0.2)] * 6),
    # structured outputs: a regex and a JSON schema neither of which can end within 24 tokens (so every request
    # ends by length; the byte tokenizer's merges make several tokenisations of one text)
    "structured": (repetitive_prompts(6, seed=9),
                   [greedy(24, structured_outputs={"regex": "[a-z ]{200}"})] * 3
                   + [greedy(24, structured_outputs={"json": INTEGERS})] * 3),
}
TARGET_OPTS = {"pair": {"max_model_len": 256}, "eagle": {"max_model_len": 128}}


@dataclass(frozen=True)
class Case:
    id: str
    spec: Callable[[dict], dict]  # model folders -> SpeculativeConfig kwargs
    target: str = "pair"  # "pair": tiny_pair's target (conftest.py); "eagle": test_eagle3's target
    batch: int = 4  # max_num_seqs of the speculative LLM
    prompts: str = "random"  # a PROMPT_SETS key
    quantization: str | None = None  # the target's, for the plain and the speculative LLM alike
    dtype: str = "float32"  # the target's (and the plain reference's); bfloat16 runs the batch-invariant kernels
    llm: dict = field(default_factory=dict)  # more speculative-LLM options
    rejects: bool = True  # rounds that reject must occur (accepted < drafted)
    check: Callable | None = None  # check(llm, outs, dirs): the case's own assertions


def rolls_back_blocks(llm, outs, dirs):
    """Rejected drafts that crossed a block boundary gave their blocks back."""
    assert llm.engine.stats["rollback_freed_blocks"] > 0


def rounds_accept_all_and_reject(llm, outs, dirs):
    rounds = sum(o.metrics["num_rounds"] for o in outs)
    rejected_rounds = sum(round(o.metrics["accepted"] / o.metrics["alpha"]) - o.metrics["accepted"]
                          for o in outs if o.metrics["alpha"])
    assert 0 < rejected_rounds < rounds  # some rounds all accepted, some rejected
    rolls_back_blocks(llm, outs, dirs)


def emits_ids_outside(ids):
    def check(llm, outs, dirs):
        assert any(t not in ids for o in outs for t in o.outputs[0].token_ids), "every emitted id is in the draft's"
    return check


def shares_the_embedding_and_quantises(llm, outs, dirs):
    draft = llm.engine.speculative.proposer.runner.model
    assert draft.embed_tokens.weight is llm.engine.model.embed_tokens.weight  # shared, not copied
    assert isinstance(draft.layers[0].mlp.down_proj, QuantizedLinear)


def cuts_the_head_to_the_subset(llm, outs, dirs):
    proposer = llm.engine.speculative.proposer
    model = getattr(proposer, "draft_model", proposer).runner.model
    assert model.lm_head.out_features == len(SUBSET)
    emits_ids_outside(set(SUBSET))(llm, outs, dirs)
    if model is not llm.engine.model and model.embed_tokens.weight is llm.engine.model.embed_tokens.weight:
        assert llm.engine.model.lm_head.out_features == VOCAB  # a self draft's cut leaves the target's head whole


def obeys_the_constraints(llm, outs, dirs):
    """The regex requests' text is in [a-z ], the JSON ones' a prefix of an array of integers."""
    texts = [o.outputs[0].text for o in outs]
    assert all(re.fullmatch(r"[a-z ]+", t) for t in texts[:3]), texts[:3]
    assert all(re.fullmatch(r"\[\s*(-?\d+\s*,\s*)*-?\d*\s*", t) for t in texts[3:]), texts[3:]


def draft(k, **kw):
    return lambda d: {"draft_model": d["draft"], "num_speculative_tokens": k, **kw}


def tree(shape, k=4, **kw):
    return lambda d: {"draft_model": d["draft"], "num_speculative_tokens": k, "tree": shape, "tree_policy": "always",
                      "tree_budget": 10, **kw}


def model_free(method, **kw):
    return lambda d: {"method": method, "num_speculative_tokens": 4, **kw}


def eagle(head="structured", **kw):
    return lambda d: {"method": "eagle3", "draft_model": d[head], "num_speculative_tokens": 3, "tree_budget": 8,
                      "tree_policy": "always", **kw}


def reduced(**kw):
    return lambda d: {"draft_model": d["draft"], "num_speculative_tokens": 4, "draft_vocab": d["subset"], **kw}


CASES = [
    # the draft model: chain length and batch
    *[Case(f"draft_model-k{k}-b{b}", draft(k), batch=b, check=rounds_accept_all_and_reject)
      for k, b in ((1, 1), (3, 4), (5, 1), (8, 4))],
    Case("draft_model-penalties", draft(4), prompts="penalties"),
    Case("draft_model-bf16_draft", draft(3, draft_dtype="bfloat16")),
    Case("draft_model-mixed_steps", draft(3), batch=5, prompts="mixed", llm={"max_num_batched_tokens": 24}),
    Case("block_verify-b1", draft(4, verify="block"), batch=1),
    Case("block_verify-b4", draft(4, verify="block")),
    Case("draft_model-adaptive", draft(4, adaptive=True), prompts="repetitive"),
    # draft-model trees, static and dynamic
    Case("tree-2211-b1", tree([2, 2, 1, 1]), batch=1),
    Case("tree-31-b4", tree([3, 1])),
    Case("tree-1111-b4", tree([1, 1, 1, 1])),
    Case("tree-dynamic-b1", tree("dynamic"), batch=1),
    Case("tree-dynamic-b4", tree("dynamic")),
    Case("tree-mixed_steps", tree([2, 2, 1], k=3), batch=5, prompts="mixed", llm={"max_num_batched_tokens": 24}),
    # model-free drafters, chains and trees
    *[Case(f"{m}-b{b}", model_free(m, **({"prompt_lookup_min": 1} if m == "prompt_lookup" else {})), batch=b,
           prompts="repetitive", check=rolls_back_blocks)
      for m in ("ngram_table", "prompt_lookup") for b in (1, 4)],
    *[Case(f"{m}-tree-{'dynamic' if s == 'dynamic' else 'static'}", model_free(m, tree=s, tree_policy="always"),
           prompts="repetitive") for m in ("prompt_lookup", "ngram_table") for s in ([3, 2, 1, 1], "dynamic")],
    # recycled candidates (the target's own top-k per token id): trees, chains (a batch above tree_max_batch_size),
    # the measured tree/chain choice, a matrix per request, prefill chunks sharing steps with rounds
    *[Case(f"recycle-tree-b{b}", model_free("recycle", tree_policy="always", tree_budget=10), batch=b,
           prompts="repetitive") for b in (1, 4)],
    Case("recycle-chain-b4", model_free("recycle", tree_max_batch_size=1), prompts="repetitive"),
    Case("recycle-measured-b4", model_free("recycle"), prompts="repetitive"),
    Case("recycle-request_scope-b4", model_free("recycle", tree_policy="always", recycle_scope="request"),
         prompts="repetitive"),
    Case("recycle-mixed_steps", model_free("recycle", tree_policy="always"), batch=5, prompts="mixed",
         llm={"max_num_batched_tokens": 24}, rejects=False),
    # suffix drafting: the request's own text and the earlier outputs of its tenant (one generate call: requests
    # that finish first are indexed before later ones draft), trees and chains, one index for every tenant
    *[Case(f"suffix-tree-b{b}", model_free("suffix", tree="dynamic", tree_policy="always", tree_budget=10), batch=b,
           prompts="repetitive") for b in (1, 4)],
    Case("suffix-chain-b4", model_free("suffix"), prompts="repetitive"),
    Case("suffix-global-b4", model_free("suffix", suffix_scope="global", suffix_max_tokens=100),
         prompts="repetitive"),
    Case("suffix-mixed_steps", model_free("suffix", tree="dynamic", tree_policy="always"), batch=5, prompts="mixed",
         llm={"max_num_batched_tokens": 24}, rejects=False),
    # pick: per request and round the best of the four model-free drafters by measured acceptance
    *[Case(f"pick-b{b}", model_free("pick", num_speculative_tokens=6), batch=b, prompts="repetitive")
      for b in (1, 4)],
    Case("pick-tree-b4", model_free("pick", tree="dynamic", tree_policy="always", tree_budget=10),
         prompts="repetitive"),
    Case("pick-mixed_steps", model_free("pick"), batch=5, prompts="mixed", llm={"max_num_batched_tokens": 24},
         rejects=False),
    # combined: prompt lookup where it matches, the draft model (or the n-gram table) elsewhere
    *[Case(f"combined-b{b}", draft(3, method="combined"), batch=b, prompts="repetitive", check=rolls_back_blocks)
      for b in (1, 4)],
    Case("combined-ngram-adaptive", draft(3, method="combined", combined_lookup="ngram_table", adaptive=True),
         prompts="repetitive"),
    # EAGLE-3 heads
    Case("eagle3-chain-b1", eagle(), target="eagle", batch=1),
    Case("eagle3-chain-b4", eagle(), target="eagle"),
    Case("eagle3-tree-221-b4", eagle(tree=[2, 2, 1]), target="eagle"),
    Case("eagle3-tree-dynamic-b1", eagle(tree="dynamic"), target="eagle", batch=1),
    Case("eagle3-tree-dynamic-b4", eagle(tree="dynamic"), target="eagle"),
    *[Case(f"eagle3-draft_vocab-{name}", eagle("head_vocab", tree=shape), target="eagle", rejects=False,
           check=emits_ids_outside(set(DRAFT_IDS))) for name, shape in (("chain", None), ("tree-dynamic", "dynamic"))],
    *[Case(f"eagle3-mixed_steps-{name}", eagle(tree=shape), target="eagle", batch=5, prompts="mixed",
           llm={"max_num_batched_tokens": 24}, rejects=False)
      for name, shape in (("chain", None), ("tree", [2, 2, 1]))],
    Case("eagle3-block_verify", eagle(verify="block"), target="eagle", rejects=False),
    Case("eagle3-adaptive", eagle(adaptive=True), target="eagle", rejects=False),
    # reduced draft vocabularies
    Case("draft_vocab-chain", reduced(), check=cuts_the_head_to_the_subset),
    Case("draft_vocab-combined", reduced(method="combined"), prompts="repetitive", check=cuts_the_head_to_the_subset),
    Case("draft_vocab-self", lambda d: {**reduced()(d), "draft_model": "self"}, rejects=False,
         check=cuts_the_head_to_the_subset),
    # structured outputs: p masked at every window row, a draft model's q masked along its drafts
    *[Case(f"structured-{name}", spec, target=target, prompts="structured", rejects=rejects,
           check=obeys_the_constraints)
      for name, spec, target, rejects in (
          ("draft_model", draft(3), "pair", True), ("block_verify", draft(4, verify="block"), "pair", True),
          ("tree-static", tree([2, 2, 1]), "pair", True), ("tree-dynamic", tree("dynamic"), "pair", True),
          ("prompt_lookup", model_free("prompt_lookup", prompt_lookup_min=1), "pair", False),
          ("ngram_table-tree", model_free("ngram_table", tree=[3, 2, 1], tree_policy="always"), "pair", True),
          ("recycle", model_free("recycle", tree_policy="always"), "pair", True),
          ("suffix", model_free("suffix", tree_policy="always"), "pair", False),
          ("pick", model_free("pick"), "pair", False),
          ("eagle3-chain", eagle(), "eagle", False), ("eagle3-tree", eagle(tree=[2, 2, 1]), "eagle", False),
          # a reduced draft vocabulary meeting a grammar: q masked over the subset's columns (all-masked rows included)
          ("draft_vocab", reduced(), "pair", True))],
    # quantised targets (int8: the w8a8 path; int4) and quantised self drafts
    *[Case(f"quantised_target-{q}", draft(3), quantization=q) for q in ("int8", "int4")],
    *[Case(f"self_draft-{q or 'fp32'}-{dq}", lambda d, dq=dq: {"draft_model": "self", "draft_quantization": dq,
                                                               "num_speculative_tokens": 4},
           quantization=q, rejects=False, check=shares_the_embedding_and_quantises)
      for q, dq in ((None, "int4"), (None, "int8"), ("int8", "int4"))],
]

# bfloat16 and bf16 + int8 / int4 targets: token identity from the batch-invariant CPU kernels (issue 33;
# LLM(batch_invariant=True): every bf16 linear and the attention compute each row the same way whatever the window,
# tree, batch or prefill chunk around it), without the fp32 cases' accepted ties - the comparison is exact
BF16_CASES = [
    Case(f"bf16-{c.id}", c.spec, target=c.target, batch=c.batch, prompts=c.prompts, quantization=q,
         dtype="bfloat16", llm=c.llm, rejects=c.rejects)
    for q in (None, "int8", "int4")
    for c in CASES if c.id in (
        "draft_model-k3-b4", "draft_model-mixed_steps", "block_verify-b1", "tree-2211-b1", "tree-dynamic-b4",
        "prompt_lookup-b1", "prompt_lookup-b4", "ngram_table-b4", "ngram_table-tree-static", "eagle3-chain-b4",
        "eagle3-tree-dynamic-b1", "eagle3-mixed_steps-tree", "recycle-tree-b4", "recycle-chain-b4", "suffix-tree-b4",
        "suffix-chain-b4", "pick-b4", "pick-tree-b4")
    if q is None or c.target == "pair"
]
CASES += BF16_CASES


@pytest.fixture(scope="module")
def dirs(tiny_pair, tmp_path_factory) -> dict[str, str]:
    """Model folders: tiny_pair's target and draft, test_eagle3's target and two of its heads, a SUBSET file."""
    root = tmp_path_factory.mktemp("parity")
    out = {"target": tiny_pair[0], "draft": tiny_pair[1], "eagle_target": str(root / "eagle_target"),
           "structured": str(root / "structured"), "head_vocab": str(root / "head_vocab"),
           "subset": str(root / "subset.json")}
    make_tiny_model(out["eagle_target"], "llama", seed=3, num_layers=LAYERS, layer_output_scale=0.3)
    for name, kw in (("structured", {"seed": 1}), ("head_vocab", {"seed": 2, "draft_ids": DRAFT_IDS})):
        make_tiny_eagle3_head(out[name], out["eagle_target"], num_heads=HEAD_HEADS, intermediate_size=HEAD_MLP, **kw)
    with open(out["subset"], "w") as f:
        json.dump(SUBSET, f)
    return out


@pytest.fixture(scope="module")
def reference(dirs):
    """``reference(target, quantization, prompt_set)``: the plain LLM's greedy tokens, computed once per key (the
    plain engines are dropped once the module is done)."""
    engines, tokens = {}, {}

    def get(target, quantization, prompt_set, dtype="float32"):
        key = (target, quantization, dtype)
        if key + (prompt_set,) not in tokens:
            if key not in engines:
                path = dirs["target"] if target == "pair" else dirs["eagle_target"]
                alone = {"max_num_seqs": 1} if dtype == "bfloat16" else {}  # bf16: every request decoded alone
                engines[key] = small_llm(path, dtype=dtype, block_size=4, quantization=quantization, **alone,
                                         **invariant(dtype), **TARGET_OPTS[target])
            prompts, params = PROMPT_SETS[prompt_set]
            outs = engines[key].generate(prompt_token_ids=prompts, sampling_params=params)  # each request alone
            tokens[key + (prompt_set,)] = [o.outputs[0].token_ids for o in outs]
        return tokens[key + (prompt_set,)]

    return get


def invariant(dtype: str) -> dict:
    """bfloat16 cases ask for the batch-invariant kernels (and are skipped where they cannot run)."""
    return {"batch_invariant": True} if dtype == "bfloat16" else {}


def skip_without_invariant_kernels(case: Case) -> None:
    if case.dtype == "bfloat16" and not batch_invariant.supported(torch.bfloat16, torch.device("cpu")):
        pytest.skip("the batch-invariant kernels need AVX512_BF16 and a C compiler")


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_greedy_speculative_equals_plain(dirs, reference, case):
    skip_without_invariant_kernels(case)
    expected = reference(case.target, case.quantization, case.prompts, case.dtype)
    path = dirs["target"] if case.target == "pair" else dirs["eagle_target"]
    llm = small_llm(path, dtype=case.dtype, block_size=4, quantization=case.quantization, max_num_seqs=case.batch,
                    speculative=SpeculativeConfig(**case.spec(dirs)), **invariant(case.dtype),
                    **TARGET_OPTS[case.target], **case.llm)
    prompts, params = PROMPT_SETS[case.prompts]
    outs = llm.generate(prompt_token_ids=prompts, sampling_params=params)
    assert [o.outputs[0].token_ids for o in outs] == expected
    assert all(o.outputs[0].finish_reason == "length" for o in outs), [o.error for o in outs]
    drafted = sum(o.metrics["drafted"] for o in outs)
    accepted = sum(o.metrics["accepted"] for o in outs)
    assert accepted > 0, "no draft was accepted: the case proves nothing about verification"
    if case.rejects:
        assert accepted < drafted, "no draft was rejected: the rollback path never ran"
    for bm in llm.engine.block_managers:  # the target's pool, then the drafter's (if it has one)
        bm.check_invariants()
        assert bm.num_free_blocks == bm.num_blocks
    if case.check is not None:
        case.check(llm, outs, dirs)


@pytest.mark.parametrize("quantization", [None, "int8", "int4"])
def test_bf16_plain_batch_equals_each_request_alone(dirs, reference, quantization):
    """A request's greedy tokens in a batch of 6 (prefill chunks admitted beside decodes) equal its tokens alone."""
    skip_without_invariant_kernels(Case("plain", draft(1), dtype="bfloat16"))
    for prompt_set in ("random", "mixed"):
        expected = reference("pair", quantization, prompt_set, "bfloat16")
        llm = small_llm(dirs["target"], dtype="bfloat16", block_size=4, quantization=quantization, max_num_seqs=6,
                        batch_invariant=True, max_num_batched_tokens=24, **TARGET_OPTS["pair"])
        prompts, params = PROMPT_SETS[prompt_set]
        outs = llm.generate(prompt_token_ids=prompts, sampling_params=params)
        assert [o.outputs[0].token_ids for o in outs] == expected
