"""A randomised, seeded property test of the engine: add, abort, step, injected faults, pool pressure, and
prompts that share prefixes (prefix caching, with eviction under the same pool pressure).

Thousands of operations; after every one, the engine's books must balance: each pool's blocks are held by the
running requests whose tables name them (refcounts match; a block a request may still write is its alone), free,
or cached and evictable - exactly one; every running request's computed KV length lies within its tokens and
its reserved slots (and the draft's view of its cache never runs ahead of the target's), every request ends
exactly once, only poisoned requests end in "error", and the run terminates with every block back in the pool.
Greedy requests that completed give the tokens of the same request decoded alone without the cache.

Three engines: plain, a draft model, and an EAGLE-3 head (whose hidden states handed over by the target must never
outlive their request nor run beyond its committed KV; it runs without the prefix cache).
"""

from __future__ import annotations

import random

import pytest
from helpers import small_llm

import specdec
from specdec import SamplingParams

NUM_OPERATIONS = 2500
FINISH_REASONS = {"length", "stop", "abort", "error"}


class Poison(RuntimeError):
    pass


def _pools(engine):
    pools = list(engine.block_managers)  # the target's pool, then the draft model's
    return pools


def _check(engine) -> None:
    running = {s.seq_id: s for s in engine.scheduler.running}
    waiting = {s.seq_id: s for s in engine.scheduler.waiting}
    assert not running.keys() & waiting.keys()
    for bm in _pools(engine):
        bm.check_invariants()  # every block referenced (refcount = tables naming it), free or evictable
        assert set(bm._tables) == set(running), "blocks owned by a request that is not running (or missing)"
    for seq in running.values():
        assert 0 <= seq.num_computed < seq.num_tokens, "a running request with nothing left to compute is stuck"
        for bm in _pools(engine):
            assert seq.num_computed <= bm.seq_len(seq.seq_id)
            # only committed tokens are ever hashed into the prefix cache, never speculative ones
            assert bm.num_chained_blocks(seq.seq_id) * bm.block_size <= seq.num_computed
        assert len(seq.output_token_ids) < seq.params.max_tokens
    for seq in waiting.values():
        assert seq.num_computed == 0
    proposer = engine.speculative.proposer if engine.speculative else None
    drafter = (proposer.draft_model or proposer) if proposer is not None else None  # an EAGLE-3 head: itself
    kv_len = getattr(drafter, "kv_len", None)
    if kv_len is not None:
        for seq_id, n in kv_len.items():
            if seq_id in running:
                assert n <= running[seq_id].num_computed, "the draft cache runs ahead of the target's"
    pending = getattr(proposer, "pending", None)  # an EAGLE-3 head's handed-over hidden states
    if pending is not None:
        assert set(pending) <= set(running), "hidden states kept for a request that is not running"
        for seq_id, rows in pending.items():
            assert all(start + t.shape[0] <= running[seq_id].num_computed for start, t in rows), \
                "hidden states kept beyond the committed KV"
    unfinished = {s.request_id for s in [*running.values(), *waiting.values()]}
    assert set(engine._requests) == unfinished


@pytest.fixture(scope="module")
def eagle_head(tiny_pair, tmp_path_factory) -> str:
    """An EAGLE-3 head for ``tiny_pair``'s two-layer target (fed its embeddings and both layers' outputs)."""
    from tiny_models import make_tiny_eagle3_head

    path = str(tmp_path_factory.mktemp("properties_eagle3"))
    make_tiny_eagle3_head(path, tiny_pair[0], seed=6, aux_layer_ids=[0, 1, 2], draft_ids=list(range(0, 300, 2)))
    return path


def _speculative_config(mode: str, draft: str, eagle_head: str) -> specdec.SpeculativeConfig | None:
    if mode == "speculative":
        return specdec.SpeculativeConfig(method="draft_model", draft_model=draft, num_speculative_tokens=3)
    if mode == "eagle3":
        return specdec.SpeculativeConfig(method="eagle3", draft_model=eagle_head, num_speculative_tokens=3)
    return None


@pytest.mark.parametrize("mode", ["plain", "speculative", "eagle3"])
def test_random_operations_keep_the_engine_consistent(tiny_pair, eagle_head, mode, monkeypatch):
    target, draft = tiny_pair
    rng = random.Random(20261122 + (mode != "plain"))
    speculative = _speculative_config(mode, draft, eagle_head)
    # a pool just above one full-length sequence: admission waits and preemption are frequent
    llm = small_llm(target, dtype="float32", block_size=4, max_model_len=48, num_kv_blocks=20, max_num_seqs=6,
                      max_num_batched_tokens=20, speculative=speculative)
    engine = llm.engine

    poisoned: dict[str, tuple[str, int]] = {}  # request id -> (stage, fail once it has this many tokens)

    def is_poisoned(seq, stage) -> bool:
        plan = poisoned.get(seq.request_id)
        return plan is not None and plan[0] == stage and len(seq.output_token_ids) >= plan[1]

    # the target forward the step runs: an EAGLE-3 engine's captures the head's hidden states
    forward_name = "forward_with_aux_hidden" if mode == "eagle3" else "forward"
    forward = getattr(engine.runner, forward_name)
    by_id = lambda seq_id: next((s for s in engine.scheduler.running if s.seq_id == seq_id), None)  # noqa: E731

    def faulty_forward(items, *args, **kwargs):  # a round's drafts on the device, the layers to capture
        if any((s := by_id(it.seq_id)) is not None and is_poisoned(s, "forward") for it in items):
            raise Poison("poisoned forward")
        return forward(items, *args, **kwargs)

    monkeypatch.setattr(engine.runner, forward_name, faulty_forward)
    if engine.speculative is not None:
        propose = engine.speculative.proposer.propose

        def faulty_propose(seqs, ks):
            if any(is_poisoned(s, "draft") for s in seqs):
                raise Poison("poisoned drafter")
            return propose(seqs, ks)

        monkeypatch.setattr(engine.speculative.proposer, "propose", faulty_propose)

    ended: dict[str, str] = {}  # request id -> finish reason (each request must end exactly once)
    preemptions = [0]
    finished_greedy: dict[str, list[int]] = {}  # completed greedy requests -> their tokens

    def record(outputs) -> None:
        for out in outputs:
            if out.finished:
                assert out.request_id not in ended, f"request {out.request_id} ended twice"
                reason = out.outputs[0].finish_reason
                assert reason in FINISH_REASONS
                error = getattr(out, "error", None)  # getattr: the old engine had no such field
                assert (reason == "error") == (error is not None)
                if reason == "error":
                    assert out.request_id in poisoned, f"an innocent request failed: {error}"
                ended[out.request_id] = reason
                preemptions[0] += out.metrics["num_preemptions"]
                if reason in ("length", "stop") and requests[out.request_id][1].temperature == 0:
                    finished_greedy[out.request_id] = out.outputs[0].token_ids

    added: list[str] = []
    requests: dict[str, tuple[list[int], SamplingParams]] = {}
    # shared prefixes (system prompts): a third of the prompts start with one of them, or with a prefix of one
    prefixes = [[rng.randrange(1, 260) for _ in range(n)] for n in (5, 9, 14)]
    for _ in range(NUM_OPERATIONS):
        op = rng.random()
        if op < 0.22:
            prompt = [rng.randrange(1, 260) for _ in range(rng.randint(1, 18))]
            if rng.random() < 0.35:
                prefix = rng.choice(prefixes)
                prompt = prefix[: rng.randint(len(prefix) // 2, len(prefix))] + prompt[: rng.randint(1, 6)]
            params = SamplingParams(temperature=rng.choice([0, 0.8]), max_tokens=rng.randint(1, 24),
                                    seed=rng.randrange(2**63), ignore_eos=rng.random() < 0.7)
            rid = engine.add_request(prompt_token_ids=prompt, params=params)
            added.append(rid)
            requests[rid] = (prompt, params)
            if rng.random() < 0.15:
                stages = ["forward", "draft"] if engine.speculative is not None else ["forward"]
                poisoned[rid] = (rng.choice(stages), rng.randint(0, 6))
        elif op < 0.30 and added:
            rid = rng.choice(added)
            out = engine.abort(rid)
            if rid in ended or out is None:
                assert out is None or rid not in ended
        else:
            record(engine.step())
        _check(engine)

    for _ in range(5000):  # drain; the bound is the "never spins" check
        if not engine.has_unfinished_requests():
            break
        record(engine.step())
        _check(engine)
    record(engine.step())  # the outputs of the last aborts
    assert not engine.has_unfinished_requests(), "the engine did not terminate"
    assert set(ended) == set(added), "a request never ended"
    for bm in _pools(engine):
        assert bm.num_free_blocks == bm.num_blocks
    reasons = list(ended.values())
    # the run exercised what it is meant to: failures, aborts, preemptions, prefix-cache hits and evictions
    assert reasons.count("error") >= 3 and reasons.count("abort") >= 3
    assert len(added) >= 300 and preemptions[0] >= 3
    stats = engine.stats
    if mode == "eagle3":  # no prefix cache: the head needs the target's hidden states of every token
        assert engine.block_manager.prefix_cache is None
        assert engine.speculative.proposer.runner.num_forwards > 100  # the head drafted
    else:
        assert stats["prefix_cache_hits"] >= 100 and stats["prefix_cache_evicted_blocks"] >= 10, stats
    # completed greedy requests (a sample) have the tokens of an uncached, unbatched, unfaulted run
    reference = small_llm(target, dtype="float32", block_size=4, max_model_len=48, enable_prefix_caching=False)
    checked = sorted(finished_greedy, key=int)[:: max(1, len(finished_greedy) // 25)]
    assert len(checked) >= 10
    for rid in checked:
        prompt, params = requests[rid]
        want = reference.generate(prompt_token_ids=[prompt], sampling_params=params)[0].outputs[0].token_ids
        assert finished_greedy[rid] == want, f"request {rid} differs from its uncached greedy run"
