"""Whole engine steps on CUDA with ``torch.cuda.set_sync_debug_mode("error")``: nothing in a step may synchronise
the stream but its host reads.

tests/engine/test_host_syncs.py counts a step's host reads on CPU (``.item()``-style reads and ``.tolist()``); it cannot
see the synchronisations a GPU makes elsewhere - ``torch.tensor(list, device="cuda")``, ``.to("cuda")`` of a
pageable CPU tensor, indexing a CUDA tensor with a Python list (the index goes to the device through a blocking
copy), ``nonzero``, ... Here every such call raises. The only synchronisation let through is ``Tensor.tolist()`` of
a CUDA tensor - the step's host read - which is counted: one per plain step and per draft-model chain round; a
draft-model tree round reads twice per depth and once to verify (the documented exception, docs/architecture.md
"Host reads", pinned on CPU by tests/engine/test_host_syncs.py).

Steps are taken through the public API (``specdec.LLM(..., speculative=...)``, ``llm.engine.step()``): plain
decoding, draft-model chains (the draft is the target itself) greedy and sampled, a draft-model tree, and a step
where a request's prefill is mixed into the decodes (plain and chain). Each engine is warmed up first: CUDA graph
capture synchronises (allowed there), so every bucket is captured before the checked steps. The engine turns
an exception in a step into failed requests (failure isolation); the test records where it was raised, so a
failure names the synchronising line.

Marked ``gpu``: excluded from the default run; selected without CUDA every test FAILS ("needs CUDA").
"""

from __future__ import annotations

import os
import traceback

import pytest
import torch
from tiny_models import make_tiny_model

import specdec
import specdec.engine.engine as engine_module
from specdec import SamplingParams, SpeculativeConfig

pytestmark = pytest.mark.gpu

K = 3
TREE = [2, 1, 1]  # 6 drafted nodes, depth 3 = K
BATCH = 2
WARMUP_STEPS = 3  # prefill, then the first rounds: every bucket the checked steps use is captured
CHECKED_STEPS = 3
READS = {"plain": 1, "chain": 1, "tree": 2 * len(TREE) + 1}  # host reads per step (see the module docstring)
REPO = os.path.dirname(os.path.dirname(os.path.abspath(specdec.__file__)))


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("sync_target"))
    make_tiny_model(path, "llama", seed=1, hidden_size=128, num_heads=4, num_kv_heads=2, intermediate_size=256)
    return path


def _where(exc: BaseException) -> str:
    """The innermost frame of this repository in ``exc``'s traceback, with the exception."""
    frames = [f for f in traceback.extract_tb(exc.__traceback__) if os.path.abspath(f.filename).startswith(REPO)]
    message = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
    if not frames:
        return message
    f = frames[-1]
    return f"{os.path.relpath(f.filename, REPO)}:{f.lineno} `{f.line}`: {message}"


class SyncChecker:
    """Runs code with the sync debug mode at "error", letting through (and counting) ``tolist()`` of CUDA tensors
    only, and records where each exception of ``compute_step`` was raised."""

    def __init__(self, monkeypatch):
        self.monkeypatch = monkeypatch
        self.reads = 0
        self.failures: list[str] = []

    def run(self, fn):
        tolist, compute_step = torch.Tensor.tolist, engine_module.compute_step

        def allowed_tolist(tensor, *args, **kwargs):
            if not tensor.is_cuda:
                return tolist(tensor, *args, **kwargs)
            self.reads += 1
            mode = torch.cuda.get_sync_debug_mode()
            torch.cuda.set_sync_debug_mode("default")
            try:
                return tolist(tensor, *args, **kwargs)
            finally:
                torch.cuda.set_sync_debug_mode(mode)

        def recording_compute_step(*args, **kwargs):
            try:
                return compute_step(*args, **kwargs)
            except BaseException as exc:
                self.failures.append(_where(exc))
                raise

        self.reads, self.failures = 0, []
        torch.cuda.synchronize()  # nothing of the warm-up is left in flight
        with self.monkeypatch.context() as patch:
            patch.setattr(torch.Tensor, "tolist", allowed_tolist)
            patch.setattr(engine_module, "compute_step", recording_compute_step)
            torch.cuda.set_sync_debug_mode("error")
            try:
                return fn()
            finally:
                torch.cuda.set_sync_debug_mode("default")
                torch.cuda.synchronize()


def test_the_checker_raises_on_a_synchronising_copy_and_counts_a_read(monkeypatch):
    """The harness itself: a blocking host-to-device copy raises under it, a CUDA ``tolist`` passes and counts."""
    checker = SyncChecker(monkeypatch)
    with pytest.raises(RuntimeError, match="synchroniz"):
        checker.run(lambda: torch.tensor([1, 2, 3], device="cuda"))
    x = torch.arange(3, device="cuda")
    assert checker.run(lambda: (x + 1).tolist()) == [1, 2, 3] and checker.reads == 1


def _engine(model: str, kind: str) -> specdec.LLM:
    spec = None if kind == "plain" else SpeculativeConfig(
        method="draft_model", draft_model=model, num_speculative_tokens=K, tree_policy="always",
        tree=TREE if kind == "tree" else None)
    return specdec.LLM(model, dtype="float32", device="cuda", block_size=16, max_model_len=256,
                       max_num_seqs=BATCH + 1, speculative=spec)


CASES = [("plain", 0.0, False), ("plain", 0.8, False), ("chain", 0.0, False), ("chain", 0.8, False),
         ("tree", 0.0, False), ("tree", 0.8, False), ("plain", 0.8, True), ("chain", 0.8, True)]


@pytest.mark.parametrize(("kind", "temperature", "admit"), CASES,
                         ids=[f"{k}-T{t}{'-prefill_mixed_in' if a else ''}" for k, t, a in CASES])
def test_a_step_synchronises_only_for_its_host_reads(model, monkeypatch, kind, temperature, admit):
    llm = _engine(model, kind)
    engine = llm.engine
    params = SamplingParams(temperature=temperature, max_tokens=200, ignore_eos=True, seed=3)
    for i in range(BATCH):
        engine.add_request(prompt_token_ids=[5 + i, 6, 7, 8, 9 + i, 10], params=params)
    for _ in range(WARMUP_STEPS):
        assert all(o.error is None for o in engine.step())
    runner = engine.runner
    drafter = engine.speculative.proposer.draft_model if engine.speculative is not None else None
    for r in (runner, drafter.runner if drafter is not None else None):
        if r is not None and r.static is not None:
            r.static.prepare()  # capture every bucket now: a capture synchronises (and a failed one turns graphs off)
    replays = runner.static.num_replays if runner.static is not None else 0
    checker = SyncChecker(monkeypatch)
    # a prefill mixed in: one step (a ragged forward: the newcomer's prompt beside the decodes or windows)
    for _ in range(1 if admit else CHECKED_STEPS):
        newcomer = engine.add_request(prompt_token_ids=[40, 41, 42, 43, 44, 45, 46], params=params) if admit else None
        before = {s.seq_id: (s.metrics.num_rounds, len(s.output_token_ids)) for s in engine.scheduler.running}
        outputs = checker.run(engine.step)
        assert not checker.failures, f"{kind} step synchronised (first site first): {checker.failures}"
        assert outputs and all(o.error is None for o in outputs), [o.error for o in outputs]
        assert checker.reads == READS[kind], f"{checker.reads} host reads in a {kind} step, expected {READS[kind]}"
        for seq in engine.scheduler.running:  # a real step ran: every decoding request advanced
            if seq.seq_id in before:
                rounds, emitted = before[seq.seq_id]
                assert len(seq.output_token_ids) > emitted
                assert seq.metrics.num_rounds == rounds + (kind != "plain"), "no verification round in the step"
        if admit:
            assert len(engine._requests[newcomer].output_token_ids) == 1, "the newcomer's prefill was not in the step"
    assert runner.static is not None, "the static forward fell back to eager (a failed capture or replay)"
    if kind != "tree" and not admit:  # decodes and chain windows went through the captured graphs
        assert runner.static.num_replays > replays, "no static forward in the checked steps"
    if drafter is not None:
        assert drafter.runner.static is not None, "the draft's static forward fell back"
