"""Host reads per engine step: a fixed number, whatever the batch size.

A host read is a device-to-host synchronisation on a GPU: ``aten._local_scalar_dense`` (``.item()``, ``bool(t)``,
``int(t)``; counted through a dispatch mode) and ``Tensor.tolist()`` (counted by wrapping it: it bypasses the
dispatcher on CPU). Each read is attributed to the innermost frame of this repository that made it: the engine
(``specdec/``) or a CPU torch reference (``kernels/``: the attention reference reads its metadata, 2 per forward,
and the spec_sample reference checks its inputs - the CUDA kernels do neither). The engine's budget: one read per
plain step (the sampled tokens with their NaN/inf flags), two per draft-model round (the k drafts after the last
draft step; the verification result). Issue 10 asks for one per round.
"""

import collections
import os
import sys
import traceback

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import specdec
from specdec import SamplingParams

K = 4
ENGINE_BUDGET = {"plain": 1, "speculative": 2}  # host reads made by specdec/ per step (per round)
REPO = os.path.dirname(os.path.dirname(os.path.abspath(specdec.__file__)))


def _origin() -> str:
    """'engine' or 'reference': where in this repository the read was made (the innermost frame that is ours)."""
    for frame in reversed(traceback.extract_stack(sys._getframe(2))):
        path = os.path.abspath(frame.filename)
        if path.startswith(os.path.join(REPO, "kernels")):
            return "reference"
        if path.startswith(os.path.join(REPO, "specdec")):
            return "engine"
    return "other"


class CountHostReads(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.counts = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten._local_scalar_dense.default:
            self.counts[_origin()] += 1
        return func(*args, **(kwargs or {}))


def host_reads_of_one_step(engine, monkeypatch) -> collections.Counter:
    counter = CountHostReads()
    tolist = torch.Tensor.tolist

    def counting_tolist(self, *args, **kwargs):
        counter.counts[_origin()] += 1
        return tolist(self, *args, **kwargs)

    with monkeypatch.context() as patch:
        patch.setattr(torch.Tensor, "tolist", counting_tolist)
        with counter:
            outputs = engine.step()
    assert outputs and all(o.error is None for o in outputs), [o.error for o in outputs]  # a real step ran
    return counter.counts


@pytest.mark.parametrize("temperature", [0.0, 0.8])
@pytest.mark.parametrize("mode", ["plain", "speculative"])
def test_host_reads_per_step_are_fixed_whatever_the_batch(tiny_pair, monkeypatch, mode, temperature):
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
    assert reads[8]["engine"] == ENGINE_BUDGET[mode], f"engine host reads {reads[8]}, budget {ENGINE_BUDGET[mode]}"
    assert reads[8]["other"] == 0, reads[8]
