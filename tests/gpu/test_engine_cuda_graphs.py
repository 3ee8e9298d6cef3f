"""The engine on CUDA with its CUDA graphs on (the default) against the same engine with ``enforce_eager=True``.

Marked ``gpu`` (``python -m bench.gpu``'s tests step); selected without CUDA every test FAILS ("needs CUDA"). The
same wiring runs on CPU in mode "eager" in tests/engine/test_static_forward_engine.py. fp32 greedy: identical tokens;
the graphs were really replayed (no silent fallback to eager) for the target's decodes and windows and for the
draft model's steps.
"""

import pytest
import torch
from tiny_models import make_tiny_model

import specdec
from specdec import SamplingParams, SpeculativeConfig

pytestmark = pytest.mark.gpu
GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    target, draft = str(tmp_path_factory.mktemp("t")), str(tmp_path_factory.mktemp("d"))
    make_tiny_model(target, "llama", seed=1, hidden_size=128, num_heads=4, num_kv_heads=2, intermediate_size=256)
    make_tiny_model(draft, "llama", seed=1, hidden_size=128, num_heads=4, num_kv_heads=2, intermediate_size=256,
                    num_layers=1)
    return target, draft


def prompts(n):
    gen = torch.Generator().manual_seed(0)
    return [torch.randint(0, 257, (int(torch.randint(3, 40, (1,), generator=gen)),), generator=gen).tolist()
            for _ in range(n)]


@pytest.mark.parametrize("speculative", [False, True], ids=["plain", "draft_model"])
@pytest.mark.parametrize("batch", [1, 5])
def test_graphs_equal_eager(models, speculative, batch):
    def make(enforce_eager):
        spec = SpeculativeConfig(draft_model=models[1], num_speculative_tokens=3) if speculative else None
        return specdec.LLM(models[0], dtype="float32", device="cuda", block_size=16, max_model_len=256,
                           max_num_seqs=batch, speculative=spec, enforce_eager=enforce_eager)

    ps = prompts(batch * 2)
    eager = make(True)
    assert eager.engine.runner.static is None
    ref = [o.outputs[0].token_ids for o in eager.generate(prompt_token_ids=ps, sampling_params=GREEDY)]
    graphs = make(False)
    got = [o.outputs[0].token_ids for o in graphs.generate(prompt_token_ids=ps, sampling_params=GREEDY)]
    assert got == ref
    runner = graphs.engine.runner
    assert runner.static is not None and runner.static.num_replays > 0, "graphs fell back to eager"
    if speculative:
        draft = graphs.engine.speculative.proposer.draft_model.runner
        assert draft.static is not None and draft.static.num_replays > 0
