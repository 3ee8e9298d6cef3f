"""Host reads per engine step must not grow with the batch size, and stay within a stated budget.

A host read is a device-to-host synchronisation on a GPU: ``aten._local_scalar_dense`` (``.item()``, ``bool(t)``,
``int(t)``, counted through a dispatch mode) and ``Tensor.tolist()`` (counted by wrapping it; it bypasses the
dispatcher on CPU). On CPU the attention reference also reads its metadata (2 per forward), which the CUDA kernel
does not; the budget below includes them. Budgets are today's counts (issue 10 asks for 1 per round eventually).
"""

import collections

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import specdec
from specdec import SamplingParams

K = 4
# (mode, temperature) -> most host reads one step (a round, for speculation) may make
BUDGET = {("plain", 0.0): 4, ("plain", 0.8): 4, ("speculative", 0.0): 13, ("speculative", 0.8): 21}


class CountHostReads(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.counts = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten._local_scalar_dense.default:
            self.counts["scalar"] += 1
        return func(*args, **(kwargs or {}))


def host_reads_of_one_step(engine, monkeypatch) -> int:
    counter = CountHostReads()
    tolist = torch.Tensor.tolist

    def counting_tolist(self, *args, **kwargs):
        counter.counts["tolist"] += 1
        return tolist(self, *args, **kwargs)

    with monkeypatch.context() as patch:
        patch.setattr(torch.Tensor, "tolist", counting_tolist)
        with counter:
            outputs = engine.step()
    assert outputs and all(o.error is None for o in outputs), [o.error for o in outputs]  # a real step ran
    return sum(counter.counts.values())


@pytest.mark.parametrize("temperature", [0.0, 0.8])
@pytest.mark.parametrize("mode", ["plain", "speculative"])
def test_host_reads_per_step_do_not_grow_with_the_batch(tiny_pair, monkeypatch, mode, temperature):
    target, _ = tiny_pair
    reads = {}
    for batch in (1, 8):
        spec = specdec.SpeculativeConfig(method="draft_model", draft_model=target, num_speculative_tokens=K) \
            if mode == "speculative" else None  # self-drafting: every round drafts k tokens
        llm = specdec.LLM(target, dtype="float32", block_size=4, max_model_len=128, max_num_seqs=batch,
                          speculative=spec)
        engine = llm.engine
        params = SamplingParams(temperature=temperature, max_tokens=60, ignore_eos=True, seed=3)
        for i in range(batch):
            engine.add_request(prompt_token_ids=[5 + i, 6, 7, 8], params=params)
        for _ in range(3):  # prefill and the first rounds: every request decoding (and drafting) now
            engine.step()
        reads[batch] = host_reads_of_one_step(engine, monkeypatch)
    assert reads[1] == reads[8], f"host reads grow with the batch: {reads}"
    assert reads[8] <= BUDGET[(mode, temperature)], f"{reads[8]} host reads, budget {BUDGET[(mode, temperature)]}"
