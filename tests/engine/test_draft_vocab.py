"""A draft whose vocabulary is smaller than the target's (Qwen2.5-7B+ targets with 0.5B-3B drafts): the draft
never sees ids it does not have, its q is zero there, and verification stays lossless."""

import pytest
import torch
from helpers import small_llm
from tiny_models import make_tiny_model

import specdec
from specdec import SamplingParams
from specdec.spec_decode.proposers.draft_model import UNKNOWN_ID_STANDIN
from specdec.spec_decode.round import SpeculativeRound

TARGET_VOCAB, DRAFT_VOCAB = 300, 280
# prompts with ids the draft lacks (>= 280); the byte tokenizer has 262 ids, so all are token-id prompts
PROMPTS = [[5, 6, 290, 7], [299, 281, 280, 12, 13], [40, 41, 42, 43, 44, 45, 295]]


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    target = str(tmp_path_factory.mktemp("vocab_target"))
    draft = str(tmp_path_factory.mktemp("vocab_draft"))
    make_tiny_model(target, "llama", seed=11, vocab_size=TARGET_VOCAB, lm_head_std=0.3)
    make_tiny_model(draft, "llama", seed=12, vocab_size=DRAFT_VOCAB, lm_head_std=0.3)
    plain = small_llm(target, dtype="float32", block_size=4, max_model_len=128)
    spec = small_llm(target, dtype="float32", block_size=4, max_model_len=128,
                       speculative=specdec.SpeculativeConfig(method="draft_model", draft_model=draft,
                                                             num_speculative_tokens=4))
    return plain, spec


def _spy_draft_inputs(spec, monkeypatch) -> list[int]:
    """Every token id the draft model is fed, recorded."""
    drafter = spec.engine.speculative.proposer
    seen: list[int] = []
    forward = drafter.runner.forward

    def spy(items, input_ids=None):
        if input_ids is None:
            for it in items:
                seen.extend(it.token_ids)
        else:  # a draft step feeds the previous drafts straight from the device
            seen.extend(input_ids.tolist())
        return forward(items, input_ids=input_ids)

    monkeypatch.setattr(drafter.runner, "forward", spy)
    return seen


def test_greedy_output_equals_the_target_and_the_draft_never_sees_unknown_ids(models, monkeypatch):
    plain, spec = models
    seen = _spy_draft_inputs(spec, monkeypatch)
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    ref = plain.generate(prompt_token_ids=PROMPTS, sampling_params=params)
    outs = spec.generate(prompt_token_ids=PROMPTS, sampling_params=params)
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in ref]
    assert all(o.outputs[0].finish_reason == "length" for o in outs), [o.error for o in outs]
    assert seen and max(seen) < DRAFT_VOCAB and UNKNOWN_ID_STANDIN in seen
    emitted = [t for o in outs for t in o.outputs[0].token_ids]
    assert max(emitted) >= DRAFT_VOCAB, "the target never emitted an id the draft lacks: the test proves nothing"
    assert sum(o.metrics["num_rounds"] for o in outs) > 0


def test_sampling_with_penalties_runs_and_drafts_stay_in_the_draft_vocab(models, monkeypatch):
    _, spec = models
    verify = SpeculativeRound.verify
    drafted: list[int] = []

    def spy(self, logits, out):
        meta = self.meta
        drafted.extend(meta.draft_token_ids.tolist())
        if meta.draft_probs is not None:
            assert torch.all(meta.draft_probs[:, DRAFT_VOCAB:] == 0), "q must be zero on ids the draft does not have"
        return verify(self, logits, out)

    monkeypatch.setattr(SpeculativeRound, "verify", spy)
    params = SamplingParams(temperature=1.0, top_p=0.95, repetition_penalty=1.3, frequency_penalty=0.5,
                            max_tokens=40, seed=7, ignore_eos=True)
    outs = spec.generate(prompt_token_ids=PROMPTS, sampling_params=params)
    assert all(o.outputs[0].finish_reason == "length" for o in outs)
    assert drafted and max(drafted) < DRAFT_VOCAB
    again = spec.generate(prompt_token_ids=PROMPTS, sampling_params=params)
    assert [o.outputs[0].token_ids for o in again] == [o.outputs[0].token_ids for o in outs]  # seeded: reproducible
