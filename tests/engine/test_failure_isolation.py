"""Fault injection: a failure inside any stage of a step ends only the request it belongs to.

For a batch of 4, one request is made to fail inside one stage of a step (drafting, its NaN draft logits, the
target forward, its NaN logits row, sampling, verification, the rollback, detokenisation). The other three must
produce exactly the tokens of an unfaulted run, the failed one ends with finish_reason "error" and a message,
no block is leaked in either pool, and the engine serves new requests afterwards. Plain and speculative, greedy
and sampled; the speculative stages with a draft model and with an EAGLE-3 head.

The faults are injected at names that exist in the engine before and after the failure-isolation rework
(runner.forward, proposer.propose, plain_step.sample_next_tokens, spec_decode.decoder.verify_round, truncate_to,
output_processor.append_text; renamed with the round-as-data refactor), so these tests also ran against the old step:
there every faulted case fails.
"""

from __future__ import annotations

import pytest
import torch
from helpers import small_llm

import specdec
import specdec.engine.output_processor as output_processor_module
import specdec.engine.plain_step as plain_step_module
import specdec.spec_decode.round as round_module
from specdec import SamplingParams

PROMPTS = [[5, 6, 7, 8, 9], [10, 11, 12], [13, 14, 15, 16, 17, 18, 19], [20, 21]]
VICTIM = 1  # index of the request that fails
MAX_TOKENS = 14


class InjectedFault(RuntimeError):
    pass


def _params(sampled: bool) -> list[SamplingParams]:
    if sampled:
        return [SamplingParams(temperature=0.9, top_p=0.95, max_tokens=MAX_TOKENS, seed=100 + i, ignore_eos=True)
                for i in range(len(PROMPTS))]
    return [SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)] * len(PROMPTS)


@pytest.fixture(scope="module")
def engines(tiny_pair, tmp_path_factory):
    from tiny_models import make_tiny_eagle3_head

    target, draft = tiny_pair
    head = str(tmp_path_factory.mktemp("isolation_eagle3"))
    make_tiny_eagle3_head(head, target, seed=6, aux_layer_ids=[0, 1, 2], draft_ids=list(range(0, 300, 2)))
    plain = small_llm(target, dtype="float32", block_size=4, max_model_len=128, num_kv_blocks=64)
    spec = small_llm(target, dtype="float32", block_size=4, max_model_len=128, num_kv_blocks=64,
                       speculative=specdec.SpeculativeConfig(method="draft_model", draft_model=draft,
                                                             num_speculative_tokens=3))
    eagle = small_llm(target, dtype="float32", block_size=4, max_model_len=128, num_kv_blocks=64,
                        speculative=specdec.SpeculativeConfig(method="eagle3", draft_model=head,
                                                              num_speculative_tokens=3))
    return {"plain": plain.engine, "speculative": spec.engine, "eagle3": eagle.engine}


def _target_forward_name(engine) -> str:
    """The runner method the step's target forward is: an EAGLE-3 engine's captures the head's hidden states."""
    reads_hidden = engine.speculative and engine.speculative.proposer.aux_hidden_layers
    return "forward_with_aux_hidden" if reads_hidden else "forward"


def _pools(engine):
    pools = list(engine.block_managers)  # the target's pool, then the draft model's
    return pools


def _assert_pools_whole(engine):
    for bm in _pools(engine):
        bm.check_invariants()
        assert bm.num_free_blocks == bm.num_blocks, "a KV block leaked"


def _run(engine, sampled: bool) -> dict[str, object]:
    """Add the 4 requests, step until none is left; the final output of each, by batch index."""
    ids = [engine.add_request(prompt_token_ids=p, params=sp) for p, sp in zip(PROMPTS, _params(sampled))]
    final = {}
    for _ in range(500):  # bounded: the engine must never spin
        if not engine.has_unfinished_requests():
            break
        for out in engine.step():
            if out.finished:
                final[out.request_id] = out
    assert not engine.has_unfinished_requests(), "the engine did not finish its requests"
    return {i: final[rid] for i, rid in enumerate(ids)}


def _is_victim(seq) -> bool:
    # the victim's fault shows once it has generated a few tokens: mid-request, not at admission
    return seq.prompt_token_ids == PROMPTS[VICTIM] and len(seq.output_token_ids) >= 2


def _inject(monkeypatch, engine, stage: str) -> None:
    """Make the victim's part of ``stage`` raise (or produce NaN logits) from its third token on."""
    victim_ids = lambda seqs: any(_is_victim(s) for s in seqs)  # noqa: E731

    def seq_of(seq_id):
        return next((s for s in engine.scheduler.running if s.seq_id == seq_id), None)

    if stage in ("forward", "nan_logits"):
        name = _target_forward_name(engine)
        forward = getattr(engine.runner, name)

        def faulty_forward(items, *args, **kwargs):  # a round's drafts on the device, the layers to capture
            seqs = [seq_of(it.seq_id) for it in items]
            hit = [s is not None and _is_victim(s) for s in seqs]
            if stage == "forward" and any(hit):
                raise InjectedFault("target forward failed for the victim")
            out = forward(items, *args, **kwargs)
            logits = out[0] if isinstance(out, tuple) else out
            if any(hit):  # NaN in every logits row of the victim
                row, rows = 0, []
                for it, h in zip(items, hit):
                    rows += list(range(row, row + it.num_logits)) if h else []
                    row += it.num_logits
                logits = logits.clone()
                logits[rows] = float("nan")
            return (logits, *out[1:]) if isinstance(out, tuple) else logits

        monkeypatch.setattr(engine.runner, name, faulty_forward)
    elif stage == "draft_nan_logits" and engine.speculative.proposer.aux_hidden_layers:  # an EAGLE-3 head's forward
        proposer = engine.speculative.proposer
        head_forward = proposer._forward

        def nan_head_forward(items, hidden, input_ids=None):
            logits = head_forward(items, hidden, input_ids)
            rows = [r for r, it in enumerate(items) if (s := seq_of(it.seq_id)) is not None and _is_victim(s)]
            if rows:  # chains: one logits row per item
                logits = logits.clone()
                logits[rows] = float("nan")
            return logits

        monkeypatch.setattr(proposer, "_forward", nan_head_forward)
    elif stage == "draft_nan_logits":
        drafter = engine.speculative.proposer
        draft_forward = drafter.runner.forward

        def nan_draft_forward(items, input_ids=None):
            logits = draft_forward(items, input_ids=input_ids)
            rows = [r for r, it in enumerate(items) if (s := seq_of(it.seq_id)) is not None and _is_victim(s)]
            if rows:
                logits = logits.clone()
                logits[rows] = float("nan")
            return logits

        monkeypatch.setattr(drafter.runner, "forward", nan_draft_forward)
    elif stage == "draft":
        propose = engine.speculative.proposer.propose

        def faulty_propose(seqs, ks):
            if victim_ids(seqs):
                raise InjectedFault("drafter failed for the victim")
            return propose(seqs, ks)

        monkeypatch.setattr(engine.speculative.proposer, "propose", faulty_propose)
    elif stage == "sample":
        sample = plain_step_module.sample_next_tokens

        def faulty_sample(logits, params, seeds, positions, contexts, **kwargs):
            victims = [s.seed for s in engine.scheduler.running if _is_victim(s)]
            if any(seed in victims for seed in seeds):
                raise InjectedFault("sampling failed for the victim")
            return sample(logits, params, seeds, positions, contexts, **kwargs)

        monkeypatch.setattr(plain_step_module, "sample_next_tokens", faulty_sample)
    elif stage == "verify":
        verify = round_module.verify_round

        def faulty_verify(logits, meta, sampling, out, **kwargs):
            if victim_ids(verifying["requests"]):
                raise InjectedFault("verification failed for the victim")
            return verify(logits, meta, sampling, out, **kwargs)

        verifying = {}
        round_verify = round_module.SpeculativeRound.verify

        def remember_requests(self, logits, out):  # the round's requests, for faulty_verify
            verifying["requests"] = self.requests
            return round_verify(self, logits, out)

        monkeypatch.setattr(round_module.SpeculativeRound, "verify", remember_requests)
        monkeypatch.setattr(round_module, "verify_round", faulty_verify)
    elif stage == "rollback":
        truncate_to = engine.block_manager.truncate_to

        def faulty_truncate_to(seq_id, new_len):
            seq = seq_of(seq_id)
            if seq is not None and _is_victim(seq):
                raise InjectedFault("rollback failed for the victim")
            return truncate_to(seq_id, new_len)

        monkeypatch.setattr(engine.block_manager, "truncate_to", faulty_truncate_to)
    elif stage == "detokenize":
        append_text = output_processor_module.append_text

        def faulty_append_text(seq, tokenizer):
            if _is_victim(seq):
                raise InjectedFault("detokenisation failed for the victim")
            return append_text(seq, tokenizer)

        monkeypatch.setattr(output_processor_module, "append_text", faulty_append_text)
    else:
        raise AssertionError(stage)


SPECULATIVE_STAGES = ("draft", "draft_nan_logits", "forward", "nan_logits", "verify", "rollback", "detokenize")
CASES = (
    [("plain", stage) for stage in ("forward", "nan_logits", "sample", "detokenize")]
    + [("speculative", stage) for stage in SPECULATIVE_STAGES]
    + [("eagle3", stage) for stage in SPECULATIVE_STAGES]
)


@pytest.mark.parametrize("sampled", [False, True], ids=["greedy", "sampled"])
@pytest.mark.parametrize("mode,stage", CASES)
def test_a_fault_in_one_request_leaves_the_others_untouched(engines, monkeypatch, mode, stage, sampled):
    engine = engines[mode]
    clean = _run(engine, sampled)
    _assert_pools_whole(engine)
    with monkeypatch.context() as patch:
        _inject(patch, engine, stage)
        faulted = _run(engine, sampled)
    victim = faulted[VICTIM]
    assert victim.outputs[0].finish_reason == "error", f"the victim ended with {victim.outputs[0].finish_reason}"
    expected = {"nan_logits": "non-finite logits", "draft_nan_logits": "non-finite draft logits"}.get(
        stage, "for the victim")
    assert victim.error is not None and expected in victim.error
    # the victim got as far as its fault: its tokens are a prefix of the clean run's
    assert victim.outputs[0].token_ids == clean[VICTIM].outputs[0].token_ids[: len(victim.outputs[0].token_ids)]
    for i in range(len(PROMPTS)):
        if i != VICTIM:
            assert faulted[i].outputs[0].finish_reason == "length"
            assert faulted[i].outputs[0].token_ids == clean[i].outputs[0].token_ids, f"request {i} changed"
    _assert_pools_whole(engine)
    assert engine.stats["failed_requests"] >= 1
    # and the engine serves new requests afterwards, exactly as before
    again = _run(engine, sampled)
    assert [o.outputs[0].token_ids for o in again.values()] == [o.outputs[0].token_ids for o in clean.values()]
    _assert_pools_whole(engine)


@pytest.mark.parametrize("mode", ["plain", "speculative", "eagle3"])
def test_a_forward_that_always_fails_ends_the_requests_of_that_step_cleanly(engines, monkeypatch, mode):
    engine = engines[mode]
    with monkeypatch.context() as patch:
        def broken(items, *args, **kwargs):
            raise InjectedFault("the device is gone")

        patch.setattr(engine.runner, _target_forward_name(engine), broken)
        outs = _run(engine, sampled=False)
    assert all(o.outputs[0].finish_reason == "error" and "the device is gone" in o.error for o in outs.values())
    _assert_pools_whole(engine)
    clean = _run(engine, sampled=False)  # the patch is gone: the engine works again
    assert all(o.outputs[0].finish_reason == "length" for o in clean.values())


@pytest.mark.parametrize("mode", ["plain", "speculative", "eagle3"])
def test_a_transient_forward_failure_is_retried_and_fails_nobody(engines, monkeypatch, mode):
    engine = engines[mode]
    clean = _run(engine, sampled=True)
    name = _target_forward_name(engine)
    forward = getattr(engine.runner, name)
    calls = {"n": 0}

    def flaky(items, *args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 3:
            raise InjectedFault("one bad forward")
        return forward(items, *args, **kwargs)

    with monkeypatch.context() as patch:
        patch.setattr(engine.runner, name, flaky)
        outs = _run(engine, sampled=True)
    assert calls["n"] > 3
    assert [o.outputs[0].token_ids for o in outs.values()] == [o.outputs[0].token_ids for o in clean.values()]
    _assert_pools_whole(engine)


def test_generate_returns_the_error_and_the_other_results(engines, monkeypatch):
    """Through the LLM facade: the innocent requests of a generate() call are not failed with the guilty one.
    (On the old engine generate() spun forever here: the alarm turns that into a failure.)"""
    import signal

    def spinning(signum, frame):
        raise AssertionError("generate() did not return within 120 s")

    previous = signal.signal(signal.SIGALRM, spinning)
    signal.alarm(120)
    try:
        _generate_returns_the_error_and_the_other_results(engines, monkeypatch)
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


def _generate_returns_the_error_and_the_other_results(engines, monkeypatch):
    engine = engines["plain"]
    llm = specdec.LLM.__new__(specdec.LLM)
    llm.engine = engine
    clean = llm.generate(prompt_token_ids=PROMPTS, sampling_params=_params(False))
    with monkeypatch.context() as patch:
        _inject(patch, engine, "nan_logits")
        outs = llm.generate(prompt_token_ids=PROMPTS, sampling_params=_params(False))
    assert [o.outputs[0].finish_reason for o in outs] == ["length", "error", "length", "length"]
    assert [o.outputs[0].token_ids for i, o in enumerate(outs) if i != VICTIM] == [
        o.outputs[0].token_ids for i, o in enumerate(clean) if i != VICTIM]
    assert torch.isfinite(torch.tensor([len(o.outputs[0].token_ids) for o in outs])).all()


@pytest.mark.parametrize("mode", ["plain", "speculative"])
def test_a_step_that_can_schedule_nothing_ends_the_stuck_requests_instead_of_spinning(engines, monkeypatch, mode):
    from specdec.engine.scheduler import ScheduledBatch

    engine = engines[mode]
    greedy = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    running = [engine.add_request(prompt_token_ids=p, params=greedy) for p in PROMPTS[:2]]
    engine.step()
    waiting = engine.add_request(prompt_token_ids=PROMPTS[2], params=greedy)
    monkeypatch.setattr(engine.scheduler, "schedule", lambda: ScheduledBatch([], []))
    outs = engine.step()
    assert sorted(o.request_id for o in outs) == sorted(running + [waiting])
    assert all(o.outputs[0].finish_reason == "error" and "could not make progress" in o.error for o in outs)
    assert not engine.has_unfinished_requests() and engine.step() == []
    _assert_pools_whole(engine)


def test_ctrl_c_inside_a_step_is_undone_and_keeps_queued_outputs(engines, monkeypatch):
    engine = engines["speculative"]
    greedy = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    ids = [engine.add_request(prompt_token_ids=p, params=greedy) for p in PROMPTS[:2]]
    engine.step()
    engine.step()
    gone = engine.add_request(prompt_token_ids=PROMPTS[2], params=greedy)
    engine.abort(gone)  # its output waits for the next step()
    drafter = engine.speculative.proposer
    draft_forward = drafter.runner.forward
    calls = {"n": 0}

    def interrupted(items, input_ids=None):
        calls["n"] += 1
        if calls["n"] == 2:  # the second draft step: the first one already moved the draft cache
            raise KeyboardInterrupt
        return draft_forward(items, input_ids=input_ids)

    with monkeypatch.context() as patch:
        patch.setattr(drafter.runner, "forward", interrupted)
        with pytest.raises(KeyboardInterrupt):
            engine.step()
    for seq in engine.scheduler.running:  # the draft cache never runs ahead of the target's
        assert drafter.kv_len.get(seq.seq_id, 0) <= seq.num_computed
    outs = engine.step()
    assert [o.request_id for o in outs if o.outputs[0].finish_reason == "abort"] == [gone]
    final = {}
    while engine.has_unfinished_requests():
        final.update({o.request_id: o for o in engine.step() if o.finished})
    assert all(final[rid].outputs[0].finish_reason == "length" for rid in ids)
    _assert_pools_whole(engine)


def test_an_aborted_id_is_not_reused_before_its_abort_is_reported(engines):
    engine = engines["plain"]
    greedy = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    engine.add_request(prompt_token_ids=PROMPTS[0], params=greedy, request_id="same")
    engine.abort("same")
    with pytest.raises(ValueError, match="already in use"):
        engine.add_request(prompt_token_ids=PROMPTS[0], params=greedy, request_id="same")
    assert [o.outputs[0].finish_reason for o in engine.step()] == ["abort"]
    engine.add_request(prompt_token_ids=PROMPTS[0], params=greedy, request_id="same")  # now free again
    while engine.has_unfinished_requests():
        engine.step()
