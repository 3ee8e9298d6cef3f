"""The draft loop (specdec/runner/draft_loop.py): a chain round's pure draft steps as one program over persistent
buffers - what a CUDA graph captures on a GPU - run here in mode "eager". The engine with the loop generates exactly
the tokens, acceptance and q of the engine without it (greedy, sampled, filtered, mixed batches, a reduced draft
vocabulary), rounds it does not serve fall back to the step-by-step loop, and a loop that fails turns itself off."""

import pytest
import torch
from helpers import small_llm
from tiny_models import make_tiny_model

from specdec import SamplingParams, SpeculativeConfig
from specdec.runner.draft_loop import DraftLoopRunner, sampling_kind
from specdec.sampling.probs import SamplingTensors
from specdec.spec_decode.proposers.draft_vocab import write_draft_vocab

GREEDY = SamplingParams(temperature=0, max_tokens=18, ignore_eos=True)
SAMPLED = SamplingParams(temperature=0.9, max_tokens=18, ignore_eos=True, seed=5)
FILTERED = SamplingParams(temperature=0.8, top_k=20, top_p=0.9, min_p=0.01, max_tokens=18, ignore_eos=True, seed=6)


def prompts(n, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 257, (int(torch.randint(3, 20, (1,), generator=gen)),), generator=gen).tolist()
            for _ in range(n)]


def engine(pair, loop: bool, k=3, **spec_kwargs):
    spec = SpeculativeConfig(draft_model=pair[1], num_speculative_tokens=k, **spec_kwargs)
    llm = small_llm(pair[0], dtype="float32", block_size=4, max_model_len=128, max_num_seqs=4, speculative=spec)
    llm.engine.enable_static_forward("eager")
    if not loop:
        llm.engine.speculative.proposer.draft_model.loop = None
    return llm


def run(llm, ps, params):
    outs = llm.generate(prompt_token_ids=ps, sampling_params=params)
    return [(o.outputs[0].token_ids, o.metrics["accepted"], o.metrics["drafted"]) for o in outs]


@pytest.mark.parametrize("params", [GREEDY, SAMPLED, FILTERED, "mixed"], ids=["greedy", "sampled", "filtered",
                                                                            "mixed"])
def test_loop_generates_what_the_step_by_step_loop_does(pair, params):
    ps = prompts(4, seed=1)
    params = [GREEDY, SAMPLED, FILTERED, GREEDY] if params == "mixed" else params
    with_loop = engine(pair, loop=True)
    got = run(with_loop, ps, params)
    assert got == run(engine(pair, loop=False), ps, params)
    loop = with_loop.engine.speculative.proposer.draft_model.loop
    assert loop.num_runs > 0  # the rounds went through the program
    # k = 3: step 0 (catch-up) by itself, then 2 pure steps (1 where the answer's end cuts k to 2)
    assert 2 in {key.steps for key in loop._buffers} <= {1, 2}


def test_loop_with_a_reduced_draft_vocabulary(pair, tmp_path):
    path = str(tmp_path / "vocab.json")
    ids = list(range(0, 300, 2))  # every other id of the tiny models' 300: drafts never propose the others
    write_draft_vocab(path, ids, [1] * len(ids), 300)
    ps = prompts(3, seed=2)
    with_loop = engine(pair, loop=True, draft_vocab=path)
    got = run(with_loop, ps, SAMPLED)
    assert got == run(engine(pair, loop=False, draft_vocab=path), ps, SAMPLED)
    assert with_loop.engine.speculative.proposer.draft_model.loop.num_runs > 0


def test_loop_with_a_quantised_draft_head(pair):
    """A quantised LM head has no plain weight: the loop takes its width from ``out_features``."""
    ps = prompts(2, seed=5)
    kwargs = dict(draft_quantization="int8", draft_quantize_lm_head=True)
    with_loop = engine(pair, loop=True, **kwargs)
    assert run(with_loop, ps, SAMPLED) == run(engine(pair, loop=False, **kwargs), ps, SAMPLED)
    assert with_loop.engine.speculative.proposer.draft_model.loop.num_runs > 0


def test_rounds_the_loop_does_not_serve_run_step_by_step(pair):
    with_loop = engine(pair, loop=True)
    loop = with_loop.engine.speculative.proposer.draft_model.loop
    penalised = SamplingParams(temperature=0.9, repetition_penalty=1.3, max_tokens=10, ignore_eos=True, seed=1)
    ps = prompts(2, seed=3)
    assert run(with_loop, ps, penalised) == run(engine(pair, loop=False), ps, penalised)
    assert loop.num_runs == 0  # penalties: the drafts go to the host every step


def test_a_failing_loop_turns_itself_off(pair, monkeypatch, caplog):
    ps = prompts(2, seed=4)
    ref = run(engine(pair, loop=False), ps, SAMPLED)
    with_loop = engine(pair, loop=True)
    drafter = with_loop.engine.speculative.proposer.draft_model

    def broken(*args, **kwargs):
        raise RuntimeError("operation not permitted when stream is capturing")

    monkeypatch.setattr(drafter.loop, "run", broken)
    with caplog.at_level("WARNING"):
        assert run(with_loop, ps, SAMPLED) == ref
    assert drafter.loop is None and "drafting step by step" in caplog.text


def test_buckets_and_kinds():
    st = SamplingTensors(*(torch.zeros(2),) * 7, any_penalty=False, any_filter=True, all_greedy=False,
                         any_greedy=False)
    assert sampling_kind(st) == "sampled+filter"
    st.any_greedy = True
    st.any_filter = False
    assert sampling_kind(st) == "mixed"
    st.all_greedy = True
    assert sampling_kind(st) == "greedy"
    pool = (torch.zeros(1, 4, 4, 1, 8), torch.zeros(1, 4, 4, 1, 8))
    model = torch.nn.Module()
    model.lm_head = torch.nn.Linear(8, 10, bias=False)
    runner = DraftLoopRunner(model, pool, block_size=4, max_blocks=3, scratch_block=0, stream=1, mode="eager",
                             batch_sizes=(1, 2, 4), max_steps=5)
    assert runner.bucket(3, 2, 2, "greedy").batch == 4
    assert runner.bucket(5, 2, 2, "greedy") is None  # more rows than the largest bucket
    assert runner.bucket(2, 6, 2, "greedy") is None  # more steps than the program holds
    assert runner.bucket(2, 2, 4, "greedy") is None  # a wider block table
    with pytest.raises(ValueError, match="cuda_graph"):
        DraftLoopRunner(model, pool, block_size=4, max_blocks=3, scratch_block=0, stream=1, mode="cuda_graph")


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    target = str(tmp_path_factory.mktemp("loop_target"))
    draft = str(tmp_path_factory.mktemp("loop_draft"))
    make_tiny_model(target, "llama", seed=3, vocab_size=300)
    make_tiny_model(draft, "llama", seed=3, vocab_size=300, perturb_from=target, perturb_scale=0.15)
    return target, draft
