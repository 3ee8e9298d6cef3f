"""Quantised targets and drafts through the engine: loading quantises exactly what ``quantize_linears`` does,
a bf16 target with an int4 draft and a quantised draft head keep the plain greedy tokens, and bad settings are
refused with a clear ValueError.
(The sampling oracle with a quantised target and draft is tests/lossless/test_quant_lossless.py.)

Greedy parity with int8 / int4 targets and quantised self drafts is in tests/lossless/test_greedy_parity.py.
NOTE: the greedy-parity tests prove the engine's bookkeeping with quantised models, deterministically on these tiny
models; on real models a quantised target's greedy tokens can differ between plain and speculative decoding on CPU
(activation rounding amplifies the attention's shape-dependent rounding: docs/guarantees.md).
"""

from __future__ import annotations

import pytest
import torch
from helpers import small_llm

from specdec import SamplingParams, SpeculativeConfig
from specdec.checkpoint.loader import load_model
from specdec.model.quant.linear import QuantizedLinear, quantize_linears

GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
PROMPTS = [[1, 2, 3, 4], [7, 9, 11, 13, 200, 17]]


def _llm(path, **kw):
    return small_llm(path, dtype=kw.pop("dtype", "float32"), kv_cache_memory_gb=0.01, max_model_len=128, **kw)


def _tokens(llm):
    return [o.outputs[0].token_ids for o in llm.generate(prompt_token_ids=PROMPTS, sampling_params=GREEDY)]


@pytest.mark.parametrize("scheme,group", [("int8", None), ("int4", 32), ("int4", 64), ("int8", 32)])
def test_loading_quantises_like_quantize_linears(tiny_pair, scheme, group):
    target = tiny_pair[0]
    quantized = load_model(target, torch.float32, torch.device("cpu"), 64, quantization=scheme,
                           quantization_group_size=group)
    reference = load_model(target, torch.float32, torch.device("cpu"), 64, prepack_weights=False)
    quantize_linears(reference, scheme, group)
    for (name, a), (_, b) in zip(quantized.named_modules(), reference.named_modules(), strict=True):
        if isinstance(a, QuantizedLinear):
            assert isinstance(b, QuantizedLinear) and a.path == b.path, name
            for x, y in zip(a.state or (a.qweight, a.scale), b.state or (b.qweight, b.scale), strict=True):
                if x is None or y is None:  # w8g's offsets, absent in both
                    assert x is y, name
                    continue
                if x.is_mkldnn or not hasattr(x, "numel") or x.layout != torch.strided:
                    continue
                assert torch.equal(x, y), name


def test_greedy_parity_bf16_target_quantised_small_draft(tiny_pair):
    target, draft = tiny_pair
    plain = _tokens(_llm(target, dtype="bfloat16"))
    spec = _llm(target, dtype="bfloat16", speculative=SpeculativeConfig(
        draft_model=draft, draft_quantization="int4", num_speculative_tokens=3))
    assert _tokens(spec) == plain


@pytest.mark.parametrize("kwargs,match", [
    ({"quantization": "fp8"}, "'int8', 'int4' or 'gguf'"),
    ({"quantization": "int4", "quantization_group_size": 48}, "does not divide"),
    ({"quantization_group_size": 32}, "without quantization"),
])
def test_bad_quantization_is_refused(tiny_pair, kwargs, match):
    with pytest.raises(ValueError, match=match):
        _llm(tiny_pair[0], **kwargs)


def test_bad_draft_quantization_is_refused(tiny_pair):
    with pytest.raises(ValueError, match="draft_quantization must be"):
        SpeculativeConfig(draft_model="self", draft_quantization="int2")
    with pytest.raises(ValueError, match="needs a draft model"):
        SpeculativeConfig(method="ngram_table", draft_quantization="int8")
    with pytest.raises(ValueError, match="draft_dtype must be the target's"):
        _llm(tiny_pair[0], speculative=SpeculativeConfig(draft_model="self", draft_dtype="bfloat16"))


@pytest.fixture(scope="module")
def tied_target(tmp_path_factory):
    from tiny_models import make_tiny_model

    path = str(tmp_path_factory.mktemp("tied_target"))
    make_tiny_model(path, "llama", seed=5, vocab_size=320, tie_word_embeddings=True)  # 320 rows: w4a8 applies
    return path


def test_quantize_lm_head_quantises_a_tied_head_as_its_own_copy(tied_target):
    default = _llm(tied_target, quantization="int4").engine.model
    assert not isinstance(default.lm_head, QuantizedLinear)  # None: a tied head stays in the model dtype
    llm = _llm(tied_target, quantization="int4", quantize_lm_head=True)
    model = llm.engine.model
    assert isinstance(model.lm_head, QuantizedLinear) and model.lm_head.out_features == 320
    assert torch.equal(model.embed_tokens.weight, default.embed_tokens.weight)  # the lookup keeps its rows
    # the head is the embedding's rows quantised like any linear
    reference = QuantizedLinear.from_weight(default.embed_tokens.weight.detach(), None, "int4")
    reference.prepare(torch.device("cpu"))
    assert reference.path == model.lm_head.path
    h = torch.randn(3, default.embed_tokens.weight.shape[1])
    assert torch.equal(model.lm_head(h), reference(h))
    plain = _tokens(llm)
    spec = _llm(tied_target, quantization="int4", quantize_lm_head=True,
                speculative=SpeculativeConfig(draft_model="self", draft_quantization="int4",
                                              draft_quantize_lm_head=True, num_speculative_tokens=3))
    assert _tokens(spec) == plain
    draft = spec.engine.speculative.proposer.runner.model
    assert isinstance(draft.lm_head, QuantizedLinear) and draft.lm_head is not spec.engine.model.lm_head


def test_quantize_lm_head_false_keeps_an_untied_head(tiny_pair):
    assert isinstance(_llm(tiny_pair[0], quantization="int8").engine.model.lm_head, QuantizedLinear)
    model = _llm(tiny_pair[0], quantization="int8", quantize_lm_head=False).engine.model
    assert not isinstance(model.lm_head, QuantizedLinear)
    assert isinstance(model.layers[0].mlp.down_proj, QuantizedLinear)


def test_bad_quantize_lm_head_is_refused(tiny_pair):
    with pytest.raises(ValueError, match="needs a quantization scheme"):
        _llm(tiny_pair[0], quantize_lm_head=True)
    with pytest.raises(ValueError, match="None, True or False"):
        _llm(tiny_pair[0], quantization="int4", quantize_lm_head="yes")
    with pytest.raises(ValueError, match="draft_quantize_lm_head=True needs"):
        SpeculativeConfig(draft_model="self", draft_quantize_lm_head=True)
