"""Host reads per engine step: a fixed number, whatever the batch size - one per plain step and one per
draft-model chain round.

A host read is a device-to-host synchronisation on a GPU: ``aten._local_scalar_dense`` (``.item()``, ``bool(t)``,
``int(t)``; counted through a dispatch mode) and ``Tensor.tolist()`` (counted by wrapping it: it bypasses the
dispatcher on CPU). Each read is attributed to the innermost frame of this repository that made it: the engine
(``specdec/``) or a CPU torch reference (``kernels/``: the attention reference reads its metadata, 2 per forward,
and the spec_sample / block_verify references check their inputs - the CUDA kernels do neither).

The engine's budget (issue 10): one read per step, plain or speculative - a plain step reads its sampled tokens
with their NaN/inf flags; a draft-model chain round keeps the k drafts on the device from the draft loop through
the target forward and verification, whose one read brings back the emitted tokens, the accepted counts, the
drafts and the NaN/inf flags of the draft and the target logits together. Greedy and sampled, token-wise and
block verification, adaptive k (its timings cost no read), a step that also admits a request (its first token
rides in the verification read), batch 1 and 8. The documented exceptions (docs/architecture.md, "Host reads")
are pinned too: penalties read the drafts at every draft step (k + 1), a tree round reads twice per depth
(2k + 1), logprobs add one read. A combined-drafter round merges lookup and draft-model drafts on the device: 1.
"""

import collections
import os
import sys
import time
import traceback

import pytest
import torch
from helpers import small_llm
from torch.utils._python_dispatch import TorchDispatchMode

import specdec
from specdec import SamplingParams
from specdec.spec_decode.cost_model import FixedCostModel

K = 4
ENGINE_BUDGET = {"plain": 1, "speculative": 1}  # host reads made by specdec/ per step (per round)
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


def _reads_at_batch(target, batch: int, spec: specdec.SpeculativeConfig | None, params: SamplingParams,
                    monkeypatch, admit: bool = False) -> tuple[collections.Counter, list[int]]:
    """Host reads of one step of ``batch`` requests that all decode (and draft, with ``spec``) in that step, and
    the number of drafts each request verified in it. ``admit``: one more request is admitted in that step
    (its whole prompt prefilled, its first token sampled: a plain row beside the verification rounds)."""
    llm = small_llm(target, dtype="float32", block_size=4, max_model_len=128, max_num_seqs=batch + admit,
                      speculative=spec)
    engine = llm.engine
    for i in range(batch):
        engine.add_request(prompt_token_ids=[5 + i, 6, 7, 8], params=params)
    for _ in range(3):  # prefill and the first rounds: every request decoding (and drafting) now
        engine.step()
    before = {s.seq_id: s.metrics.num_drafted for s in engine.scheduler.running}
    if admit:
        newcomer = engine.add_request(prompt_token_ids=[9, 10, 11], params=params)
    reads = host_reads_of_one_step(engine, monkeypatch)
    drafted = [s.metrics.num_drafted - before[s.seq_id] for s in engine.scheduler.running if s.seq_id in before]
    if admit:
        assert len(engine._requests[newcomer].output_token_ids) == 1, "the newcomer's prefill was not in the step"
    return reads, drafted


def _self_drafting(**kwargs) -> specdec.SpeculativeConfig:
    return specdec.SpeculativeConfig(method="draft_model", num_speculative_tokens=K, **kwargs)


def _spec_config(mode: str, target: str) -> specdec.SpeculativeConfig | None:
    """Self-drafting (every round drafts k tokens, all accepted when greedy) in the flavour ``mode`` names."""
    if mode == "plain":
        return None
    if mode == "speculative_adaptive":  # fixed costs: k stays at its maximum, but every forward is timed
        return _self_drafting(draft_model=target, adaptive=True, cost_model=FixedCostModel(c=0.0))
    return _self_drafting(draft_model=target, verify="block" if mode == "speculative_block" else "token")


@pytest.mark.parametrize("temperature", [0.0, 0.8])
@pytest.mark.parametrize("mode", ["plain", "speculative", "speculative_block", "speculative_adaptive",
                                  "speculative_admitting"])
def test_host_reads_per_step_are_one_whatever_the_batch(tiny_pair, monkeypatch, mode, temperature):
    target, _ = tiny_pair
    reads = {}
    for batch in (1, 8):
        spec = _spec_config("speculative" if mode == "speculative_admitting" else mode, target)
        params = SamplingParams(temperature=temperature, max_tokens=60, ignore_eos=True, seed=3)
        reads[batch], drafted = _reads_at_batch(target, batch, spec, params, monkeypatch,
                                                admit=mode == "speculative_admitting")
        assert drafted == ([0] * batch if spec is None else [K] * batch), drafted  # the step is what we count
    budget = ENGINE_BUDGET["plain" if mode == "plain" else "speculative"]
    assert reads[1] == reads[8], f"host reads grow with the batch: {reads}"
    assert reads[8]["engine"] == budget, f"engine host reads {reads[8]}, budget {budget}"
    assert reads[8]["other"] == 0, reads[8]


def test_a_combined_round_mixing_lookup_and_model_drafts_reads_once(tiny_pair, monkeypatch):
    """The combined drafter merges the lookup's host drafts with the draft model's device drafts on the device:
    still one read. Odd requests repeat their prompt, so in the counted step of the batch of 8 some requests take
    prompt-lookup drafts and the others the draft model's (asserted: the step mixes both)."""
    target, _ = tiny_pair
    reads, hits = {}, []
    for batch in (1, 8):
        llm = small_llm(target, dtype="float32", block_size=4, max_model_len=128, max_num_seqs=batch,
                          speculative=specdec.SpeculativeConfig(method="combined", draft_model=target,
                                                                num_speculative_tokens=K))
        engine = llm.engine
        for i in range(batch):
            prompt = [5 + i, 6, 7, 8, 9, 5 + i, 6, 7, 8, 9] if i % 2 else [5 + i, 6, 7, 8]
            engine.add_request(prompt_token_ids=prompt, params=SamplingParams(temperature=0, max_tokens=60,
                                                                              ignore_eos=True))
        for _ in range(3):
            engine.step()
        lookup = engine.speculative.proposer.lookup
        propose = lookup.propose

        def spy(seqs, ks, propose=propose):
            proposal = propose(seqs, ks)
            hits.append([bool(d) for d in proposal.token_ids])
            return proposal

        monkeypatch.setattr(lookup, "propose", spy)
        reads[batch] = host_reads_of_one_step(engine, monkeypatch)
    assert any(hits[-1]) and not all(hits[-1]), f"the counted step did not mix lookup and model drafts: {hits}"
    assert reads[1]["engine"] == reads[8]["engine"] == ENGINE_BUDGET["speculative"], reads


@pytest.mark.parametrize("tree", [None, "dynamic"])
@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_an_eagle3_round_reads_as_a_draft_models_whatever_the_batch(tiny_pair, tmp_path, monkeypatch, temperature,
                                                                    tree):
    """An EAGLE-3 head's chain round keeps its drafts on the device like a draft model's, and the target's hidden
    states go from the forward to the head without a read: one read per chain round, 2k + 1 per tree round."""
    from tiny_models import make_tiny_eagle3_head

    target, _ = tiny_pair
    head = str(tmp_path / "head")
    make_tiny_eagle3_head(head, target, seed=6, aux_layer_ids=[0, 1, 2], draft_ids=list(range(0, 300, 2)))
    spec = specdec.SpeculativeConfig(method="eagle3", draft_model=head, num_speculative_tokens=K, tree=tree,
                                     tree_policy="always")
    params = SamplingParams(temperature=temperature, max_tokens=60, ignore_eos=True, seed=3)
    reads = {}
    for batch in (1, 4):
        reads[batch], drafted = _reads_at_batch(target, batch, spec, params, monkeypatch)
        assert tree is not None or drafted == [K] * batch, drafted
    expected = ENGINE_BUDGET["speculative"] if tree is None else 2 * K + 1
    assert reads[1]["engine"] == reads[4]["engine"] == expected, reads


@pytest.mark.parametrize("feature", ["penalties", "tree", "logprobs"])
def test_the_documented_exceptions_read_a_fixed_number_whatever_the_batch(tiny_pair, monkeypatch, feature):
    """Penalties: the drafts so far on the host at every draft step, then the verification read (k + 1). A
    tree round: per depth q's top probabilities and the drawn children, then the verification read (2k + 1).
    Logprobs: one more read for the emitted tokens' logprobs (1 + 1)."""
    target, _ = tiny_pair
    tree = {"tree": "dynamic", "tree_policy": "always"} if feature == "tree" else {}
    spec = _self_drafting(draft_model=target, **tree)
    params = SamplingParams(temperature=0.8, max_tokens=60, ignore_eos=True, seed=3,
                            **{"penalties": {"repetition_penalty": 1.2}, "tree": {},
                               "logprobs": {"logprobs": 2}}[feature])
    expected = {"penalties": K + 1, "tree": 2 * K + 1, "logprobs": ENGINE_BUDGET["speculative"] + 1}[feature]
    reads = {batch: _reads_at_batch(target, batch, spec, params, monkeypatch)[0] for batch in (1, 4)}
    assert reads[1]["engine"] == reads[4]["engine"] == expected, reads


class _FakeCudaEvent:
    """Stands in for ``torch.cuda.Event`` (no GPU here): records a fake clock, completes when the test says so."""

    clock = 0.0
    made: list["_FakeCudaEvent"] = []

    def __init__(self, enable_timing: bool = False):
        assert enable_timing
        self.time, self.done = None, False
        _FakeCudaEvent.made.append(self)

    def record(self):
        self.time = _FakeCudaEvent.clock

    def query(self) -> bool:
        return self.done

    def elapsed_time(self, end: "_FakeCudaEvent") -> float:
        assert self.done and end.done, "elapsed_time of an event that has not completed (a CUDA error)"
        return (end.time - self.time) * 1000.0  # milliseconds


def test_adaptive_timings_wait_for_nothing_on_cuda(monkeypatch):
    """On CUDA a timed forward is a pair of events, recorded into the cost model only once the end event has
    completed (after the step's host read), never through a synchronize; on CPU at once."""
    from specdec.spec_decode.forward_timer import ForwardTimer

    def no_sync(*args, **kwargs):
        raise AssertionError("the timer synchronised the device")

    monkeypatch.setattr(torch.cuda, "Event", _FakeCudaEvent)
    monkeypatch.setattr(torch.cuda, "synchronize", no_sync)
    monkeypatch.setattr(_FakeCudaEvent, "made", [])
    timer, seen = ForwardTimer(), []
    _FakeCudaEvent.clock = 1.0
    start = timer.start(torch.device("cuda"))
    _FakeCudaEvent.clock = 3.5
    timer.stop(start, seen.append)
    timer.flush()
    assert seen == [], "recorded before the forward completed"
    for event in _FakeCudaEvent.made:
        event.done = True
    timer.flush()
    timer.flush()  # recorded once
    assert seen == [2.5]

    clock = time.thread_time if torch.get_num_threads() == 1 else time.perf_counter  # the timer's CPU clock
    before = clock()
    timer.stop(timer.start(torch.device("cpu")), seen.append)  # CPU clocks: recorded at once
    assert len(seen) == 2 and 0.0 <= seen[1] <= clock() - before  # seconds, within the span around it
