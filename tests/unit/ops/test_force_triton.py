"""The dispatch contract end to end: with ops.force_triton() every op runs its Triton kernel (here in the
interpreter), and plain and speculative generation give exactly the reference path's tokens."""

import pytest
from helpers import small_llm
from tiny_models import make_tiny_model

from specdec import SamplingParams, SpeculativeConfig, ops


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    target = str(tmp_path_factory.mktemp("ft_target"))
    draft = str(tmp_path_factory.mktemp("ft_draft"))
    small = dict(hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1, intermediate_size=64)
    make_tiny_model(target, "llama", seed=21, **small)
    make_tiny_model(draft, "llama", seed=21, perturb_from=target, perturb_scale=0.2, **small)
    return target, draft


def test_kernels_are_really_used_when_forced(monkeypatch):
    from specdec.kernels import paged_attention

    called = []
    original = paged_attention.paged_attention
    monkeypatch.setattr(paged_attention, "paged_attention", lambda *a, **k: called.append(1) or original(*a, **k))
    import torch

    q = torch.randn(1, 2, 16)
    cache = torch.randn(1, 4, 1, 16)
    args = (q, cache, cache, torch.zeros(1, 1, dtype=torch.int32), torch.tensor([1], dtype=torch.int32),
            torch.tensor([0, 1], dtype=torch.int32), 0.25)
    ops.paged_attention(*args)
    assert not called
    with ops.force_triton():
        ops.paged_attention(*args)
    assert called


@pytest.mark.parametrize("speculative", [False, True])
def test_forced_triton_generation_equals_the_reference_path(pair, speculative):
    target, draft = pair
    spec = SpeculativeConfig(draft_model=draft, num_speculative_tokens=2) if speculative else None
    llm = small_llm(target, dtype="float32", block_size=4, max_model_len=64, speculative=spec)
    prompts = [[5, 6, 7, 8, 9], [10, 11, 12]]
    params = [SamplingParams(temperature=0, max_tokens=4, ignore_eos=True),
              SamplingParams(temperature=0.9, top_k=30, top_p=0.9, max_tokens=4, seed=3, ignore_eos=True)]
    reference = [o.outputs[0].token_ids for o in llm.generate(prompt_token_ids=prompts, sampling_params=params)]
    with ops.force_triton():
        forced = [o.outputs[0].token_ids for o in llm.generate(prompt_token_ids=prompts, sampling_params=params)]
    assert forced == reference
