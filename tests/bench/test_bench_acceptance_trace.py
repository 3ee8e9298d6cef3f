"""bench.acceptance.acceptance_trace: a chain round at p accepts the run of teacher-forced matches from p - checked
against the engine's own greedy speculative decoding on tiny models (fp32, where the texts are the same)."""

import pytest
from tiny_models import make_tiny_model

import specdec
from bench.acceptance.acceptance_trace import accepted_run, draft_matches

pytestmark = pytest.mark.bench


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    root = tmp_path_factory.mktemp("trace")
    make_tiny_model(str(root / "target"), seed=1)
    make_tiny_model(str(root / "draft"), seed=1, perturb_from=None)  # the same weights: every draft matches
    make_tiny_model(str(root / "other"), seed=1, perturb_from=str(root / "target"), perturb_scale=0.5)
    return root


def greedy(path, ids, n, spec=None):
    llm = specdec.LLM(str(path), dtype="float32", max_model_len=256, num_kv_blocks=64, speculative=spec)
    out = llm.generate(prompt_token_ids=[ids], sampling_params=specdec.SamplingParams(temperature=0, max_tokens=n,
                                                                                       ignore_eos=True))[0]
    return llm, list(out.outputs[0].token_ids), out.metrics


def test_matches_price_every_round_of_a_fixed_k_chain(pair):
    ids = [5, 17, 33, 2, 90, 41]
    target, text, _ = greedy(pair / "target", ids, 40)
    same = specdec.LLM(str(pair / "draft"), dtype="float32", max_model_len=256, num_kv_blocks=64)
    assert draft_matches(same.engine, ids, text) == [1] * len(text)
    other = specdec.LLM(str(pair / "other"), dtype="float32", max_model_len=256, num_kv_blocks=64)
    match = draft_matches(other.engine, ids, text)
    assert 0 < sum(match) < len(match)  # a partial match: the replay below is not trivial
    k = 3
    spec = specdec.SpeculativeConfig(method="draft_model", draft_model=str(pair / "other"), num_speculative_tokens=k)
    _, spec_text, metrics = greedy(pair / "target", ids, 40, spec)
    assert spec_text == text
    pos, accepted = 1, 0  # the first token comes from the prefill
    while pos < len(text):
        a = accepted_run(match, pos, k)
        accepted += a
        pos += a + 1
    assert metrics["accepted"] == accepted
