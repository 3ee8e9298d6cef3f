"""The engine's static-forward wiring (LLMEngine.enable_static_forward -> ModelRunner -> StaticForwardRunner),
exercised on CPU in mode "eager": the same buckets, padding rows and scratch block a CUDA graph replays, without
the capture. Greedy tokens equal the all-eager engine's (fp32), uniform forwards really go through the buckets, so
do a model-free drafter's ragged windows (padded to one q_len), the scratch block never leaks into a request, and a
failing static path falls back to eager.
"""

import pytest
import torch
from helpers import small_llm

from specdec import SamplingParams, SpeculativeConfig
from specdec.runner.cuda_graphs import SCRATCH_SEQ_ID

GREEDY = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
SAMPLED = SamplingParams(temperature=0.8, max_tokens=20, ignore_eos=True, seed=7)


def prompts(n, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 257, (int(torch.randint(3, 30, (1,), generator=gen)),), generator=gen).tolist()
            for _ in range(n)]


def llm(target, draft=None, k=3, static=True, speculative=None, **kwargs):
    spec = SpeculativeConfig(draft_model=draft, num_speculative_tokens=k) if draft else speculative
    out = small_llm(target, dtype="float32", block_size=4, max_model_len=128, max_num_seqs=6,
                      speculative=spec, **kwargs)
    if static:
        out.engine.enable_static_forward("eager")
    return out


def tokens(outs):
    return [o.outputs[0].token_ids for o in outs]


@pytest.mark.parametrize("params", [GREEDY, SAMPLED], ids=["greedy", "sampled"])
def test_plain_engine_static_equals_eager(tiny_pair, params):
    ps = prompts(5, seed=1)
    ref = tokens(llm(tiny_pair[0], static=False).generate(prompt_token_ids=ps, sampling_params=params))
    engine = llm(tiny_pair[0])
    assert tokens(engine.generate(prompt_token_ids=ps, sampling_params=params)) == ref
    static = engine.engine.runner.static
    assert static.num_replays > 0  # the decodes went through the buckets
    assert 6 in {key.batch for key in static._batches}  # 5 running requests: bucket 6 (max_num_seqs), 1 padding row


def test_speculative_engine_static_equals_eager(tiny_pair):
    ps = prompts(5, seed=2)
    ref = tokens(llm(*tiny_pair, static=False).generate(prompt_token_ids=ps, sampling_params=GREEDY))
    engine = llm(*tiny_pair)
    outs = engine.generate(prompt_token_ids=ps, sampling_params=GREEDY)
    assert tokens(outs) == ref
    target, draft = engine.engine.runner.static, engine.engine.speculative.proposer.draft_model.runner.static
    assert draft.num_replays > 0  # one-token draft steps
    assert any(key.q_len > 1 for key in target._batches)  # chain windows of one length for the whole batch
    for bm in engine.engine.block_managers:
        bm.check_invariants()
        # every request's blocks came back; only the scratch block stays taken, by its pseudo-sequence
        assert bm.num_free_blocks == bm.num_blocks - 1 and bm.has_seq(SCRATCH_SEQ_ID)


def test_ragged_prompt_lookup_windows_replay_padded_and_equal_eager(tiny_pair):
    """Prompt lookup drafts a different number of tokens per request (repetitive prompts match, random ones do
    not): the verification windows are ragged, padded to one captured q_len, and served by the buckets."""
    spec = SpeculativeConfig(method="prompt_lookup", num_speculative_tokens=3, prompt_lookup_min=1)
    ps = prompts(3, seed=4) + [[5, 6, 7, 8] * 6, [9, 10, 11] * 7]
    ref = tokens(llm(tiny_pair[0], static=False, speculative=spec).generate(prompt_token_ids=ps,
                                                                             sampling_params=GREEDY))
    engine = llm(tiny_pair[0], speculative=spec)
    runner = engine.engine.runner
    ragged = []
    original = runner.padded_q_len

    def spy(items):
        q_len = original(items)
        ragged.append(q_len is not None)
        return q_len

    runner.padded_q_len = spy
    assert tokens(engine.generate(prompt_token_ids=ps, sampling_params=GREEDY)) == ref
    assert any(ragged)  # some verification batches were ragged and were padded
    assert runner.static.num_fallbacks == 0
    for bm in engine.engine.block_managers:
        bm.check_invariants()
        assert bm.num_free_blocks == bm.num_blocks - 1 and bm.has_seq(SCRATCH_SEQ_ID)


def test_static_failure_falls_back_to_eager(tiny_pair, monkeypatch, caplog):
    ps = prompts(3, seed=3)
    ref = tokens(llm(tiny_pair[0], static=False).generate(prompt_token_ids=ps, sampling_params=GREEDY))
    engine = llm(tiny_pair[0])
    runner = engine.engine.runner

    def broken(*args, **kwargs):
        raise RuntimeError("capture not supported here")

    monkeypatch.setattr(runner.static, "run", broken)
    with caplog.at_level("WARNING"):
        assert tokens(engine.generate(prompt_token_ids=ps, sampling_params=GREEDY)) == ref
    assert runner.static is None and "running every forward eagerly" in caplog.text


def test_cpu_default_is_eager_and_no_scratch_block(tiny_pair):
    engine = small_llm(tiny_pair[0], dtype="float32", block_size=4, max_model_len=64)
    assert engine.engine.runner.static is None
    assert not engine.engine.block_manager.has_seq(SCRATCH_SEQ_ID)


def test_enabling_twice_keeps_one_scratch_block(tiny_pair):
    """On CUDA the engine enables graphs at start-up; a second call (a bench's twin, another mode) replaces the
    runner and keeps the scratch block instead of taking another one (or failing on the pseudo-sequence)."""
    engine = llm(tiny_pair[0])
    bm, runner = engine.engine.block_manager, engine.engine.runner
    scratch, free = runner.scratch_block, bm.num_free_blocks
    engine.engine.enable_static_forward("eager", block_buckets=(1, 2, 4))
    assert runner.scratch_block == scratch and bm.num_free_blocks == free
    assert runner.static.block_buckets[-1] == runner.static.max_blocks
    ps = prompts(2, seed=4)
    assert tokens(engine.generate(prompt_token_ids=ps, sampling_params=GREEDY)) == \
        tokens(llm(tiny_pair[0], static=False).generate(prompt_token_ids=ps, sampling_params=GREEDY))
    bm.check_invariants()
