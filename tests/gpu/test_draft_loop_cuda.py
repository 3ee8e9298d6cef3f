"""The draft loop captured as one CUDA graph per bucket (specdec/runner/draft_loop.py) against the step-by-step
draft loop on the same device: identical tokens and acceptance, greedy and sampled (fp32), and the program really
replayed (no silent fallback). Marked ``gpu``; without CUDA every test FAILS ("needs CUDA"). The same program runs
on CPU in mode "eager" in tests/unit/runner/test_draft_loop.py."""

import pytest
import torch
from tiny_models import make_tiny_model

import specdec
from specdec import SamplingParams, SpeculativeConfig

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    target, draft = str(tmp_path_factory.mktemp("t")), str(tmp_path_factory.mktemp("d"))
    make_tiny_model(target, "llama", seed=1, hidden_size=128, num_heads=4, num_kv_heads=2, intermediate_size=256)
    make_tiny_model(draft, "llama", seed=1, hidden_size=128, num_heads=4, num_kv_heads=2, intermediate_size=256,
                    num_layers=1)
    return target, draft


@pytest.mark.parametrize("params", [SamplingParams(temperature=0, max_tokens=24, ignore_eos=True),
                                    SamplingParams(temperature=0.8, top_p=0.9, max_tokens=24, ignore_eos=True,
                                                   seed=3)], ids=["greedy", "sampled"])
def test_captured_draft_loop_equals_the_step_by_step_loop(models, params, no_tf32):
    gen = torch.Generator().manual_seed(0)
    ps = [torch.randint(0, 257, (int(torch.randint(3, 40, (1,), generator=gen)),), generator=gen).tolist()
          for _ in range(4)]  # a whole bucket: the LM head sees as many rows in both loops (GEMM rounding)

    def make(loop: bool):
        llm = specdec.LLM(models[0], dtype="float32", device="cuda", block_size=16, max_model_len=256,
                          speculative=SpeculativeConfig(draft_model=models[1], num_speculative_tokens=4))
        if not loop:
            llm.engine.speculative.proposer.draft_model.loop = None
        return llm

    def run(llm):
        outs = llm.generate(prompt_token_ids=ps, sampling_params=params)
        assert all(o.error is None for o in outs)
        return [(o.outputs[0].token_ids, o.metrics["accepted"]) for o in outs]

    with_loop = make(True)
    got = run(with_loop)
    loop = with_loop.engine.speculative.proposer.draft_model.loop
    assert loop is not None and loop.mode == "cuda_graph", "the draft loop fell back (see the warning)"
    assert loop.num_runs > 0 and all(b.graph is not None for b in loop._buffers.values())
    assert got == run(make(False))
