"""Speculative sampling stays lossless with a quantised target (int8: the CPU w8a8 path) and a quantised draft
(``draft_model="self"`` with int4, and a separate int4 draft): the engine's joint of k + 2 tokens against the exact
joint of the target *as loaded*.

Oracle: transformers' LlamaForCausalLM with each ``nn.Linear`` replaced by a ``QuantizedLinear`` quantised from
the same weights and prepared the same way - per-channel / per-group quantisation and per-row activation
quantisation act on each output row and each input row alone, so q, k and v quantised apart equal our fused
qkv_proj quantised whole. Everything else (attention, norms, the exact joint, the chi-square bound) is that of
tests/oracle.py.
"""

from __future__ import annotations

import itertools

import pytest
import torch
from helpers import small_llm
from oracle import CONFIGS, PROMPT, VOCAB, check, exact_joint, lossless_llm, make_lossless_pair, run

import specdec
from specdec.model.quant.linear import QuantizedLinear

N = 3000
K = 2
TARGET_SCHEME = "int8"


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory):
    return make_lossless_pair(tmp_path_factory.mktemp("quant_lossless"))




def quantised_prefix_logits(target_dir: str, scheme: str, max_m: int) -> dict[tuple[int, ...], torch.Tensor]:
    """float64 next-token logits of transformers' target with its linears quantised like ours (see above)."""
    import transformers

    model = transformers.LlamaForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is torch.nn.Linear:
                bias = child.bias.detach().clone() if child.bias is not None else None
                q = QuantizedLinear.from_weight(child.weight.detach(), bias, scheme)
                q.prepare(torch.device("cpu"))
                setattr(parent, name, q)
    table = {}
    with torch.no_grad():
        for length in range(max_m):
            prefixes = list(itertools.product(range(VOCAB), repeat=length))
            ids = torch.tensor([PROMPT + list(p) for p in prefixes], dtype=torch.int64)
            table.update(zip(prefixes, model(ids).logits[:, -1].double()))
    return table


@pytest.mark.parametrize("draft", ["self-int4", "separate-int4"])
def test_quantised_target_and_draft_are_lossless(model_dirs, draft):
    target, draft_dir = model_dirs
    cfg, m, label = CONFIGS["top_k_top_p"], K + 2, f"int8 target, {draft} draft"
    spec = specdec.SpeculativeConfig(draft_model="self" if draft.startswith("self") else draft_dir,
                                     draft_quantization="int4", num_speculative_tokens=K)
    llm = lossless_llm(target, spec) if TARGET_SCHEME is None else small_llm(
        target, dtype="float32", max_model_len=32, block_size=4, max_num_seqs=256, kv_cache_memory_gb=0.02,
        speculative=spec, quantization=TARGET_SCHEME)
    assert llm.engine.model.layers[0].mlp.down_proj.path == "w8a8"
    counts, metrics = run(llm, cfg, m, N, label)
    joint = exact_joint(quantised_prefix_logits(target, TARGET_SCHEME, m), cfg, m)
    stat, bound = check(label, counts, joint)
    assert stat < bound, f"{label}: not lossless w.r.t. the quantised target (chi-square {stat:.1f} >= {bound:.1f})"
    drafted = sum(x["drafted"] for x in metrics)
    rejected = sum(x["accepted"] < x["drafted"] for x in metrics)
    assert drafted > 0 and rejected > 0  # both branches of verification ran


def test_a_quantised_target_is_a_different_target(model_dirs):
    """The joint the test above checks against is not the fp32 target's: quantisation moves it (by more than the
    chi-square test at N=3000 resolves on this tiny model, so the check is on the exact joints themselves)."""
    from oracle import target_prefix_logits

    target, _ = model_dirs
    cfg, m = CONFIGS["top_k_top_p"], K + 2
    fp32 = exact_joint(target_prefix_logits(target, PROMPT, m), cfg, m)
    quantised = exact_joint(quantised_prefix_logits(target, TARGET_SCHEME, m), cfg, m)
    assert float((fp32 - quantised).abs().max()) > 1e-5
