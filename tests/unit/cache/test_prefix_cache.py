"""Prefix caching: chained block keys, reference counts, LRU eviction, and the engine computing only what follows a
cached prefix - with the same greedy tokens as without the cache, across speculative rollback, preemption,
eviction, aborts and failures (fp32, tiny random models, block_size 4 so that pages turn often)."""

from __future__ import annotations

import random

import pytest
import torch
from helpers import small_llm
from hypothesis import given, settings
from hypothesis import strategies as st

from specdec import SamplingParams, SpeculativeConfig
from specdec.cache.block_manager import BlockManager
from specdec.cache.prefix_cache import ROOT, block_key

BS = 4
GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


# --- the block manager -----------------------------------------------------------------------------------------
def test_keys_chain_the_prefix_before_a_block():
    a, b = [1, 2, 3, 4], [5, 6, 7, 8]
    assert block_key(ROOT, b) != block_key(block_key(ROOT, a), b)  # same tokens, other prefix: other key
    assert block_key(block_key(ROOT, a), b) == block_key(block_key(ROOT, list(a)), tuple(b))
    assert block_key(ROOT, [1, 2, 3, 4]) != block_key(ROOT, [1, 2, 3, 5])


def _registered(bm: BlockManager, seq_id: int, tokens: list[int], num_tokens: int | None = None) -> int:
    cached = bm.allocate(seq_id, num_tokens or len(tokens), tokens)
    bm.register_committed(seq_id, tokens)
    bm.check_invariants()
    return cached


def test_a_shared_prefix_is_matched_block_by_block_and_the_last_two_tokens_are_recomputed():
    bm = BlockManager(16, BS, enable_prefix_caching=True)
    prompt = list(range(10, 20))  # 2 full blocks + 2 tokens
    assert _registered(bm, 0, prompt) == 0
    assert bm.prefix_cache is not None and len(bm.prefix_cache) == 2
    # same first block, other second block: 1 block shared
    assert bm.allocate(1, 10, prompt[:4] + [99] + prompt[5:]) == 4
    assert bm.block_table(1)[0] == bm.block_table(0)[0] and bm.block_table(1)[1] != bm.block_table(0)[1]
    assert bm.refcount(bm.block_table(0)[0]) == 2
    # the two cached blocks and 0 or 1 token more: the last two tokens are recomputed, so only one block is served
    assert bm.allocate(2, 8, prompt[:8]) == 4
    assert bm.allocate(5, 9, prompt[:9]) == 4
    assert bm.allocate(3, 12, prompt + [7, 7]) == 8
    assert bm.stats == {"prefix_cache_queries": 10 + 10 + 8 + 9 + 12, "prefix_cache_hits": 0 + 4 + 4 + 4 + 8,
                        "prefix_cache_evicted_blocks": 0}
    bm.check_invariants()
    for s in range(6):
        bm.free(s)
    bm.check_invariants()
    assert bm.num_free_blocks == bm.num_blocks and bm.num_evictable_blocks == 2


def test_without_prefix_caching_nothing_is_shared_or_counted():
    bm = BlockManager(16, BS)
    prompt = list(range(10, 20))
    assert bm.allocate(0, 10, prompt) == 0
    assert bm.register_committed(0, prompt) == 0
    assert bm.allocate(1, 10, prompt) == 0
    assert not set(bm.block_table(0)) & set(bm.block_table(1))
    assert bm.stats == {"prefix_cache_queries": 0, "prefix_cache_hits": 0, "prefix_cache_evicted_blocks": 0}


def test_unreferenced_cached_blocks_are_evicted_lru_tail_first_and_only_when_free_blocks_run_out():
    bm = BlockManager(6, BS, enable_prefix_caching=True)
    a = list(range(100, 109))  # 2 full blocks + 1
    b = list(range(200, 209))
    _registered(bm, 0, a)
    _registered(bm, 1, b)
    a_blocks, b_blocks = bm.block_table(0)[:2], bm.block_table(1)[:2]
    bm.free(0)  # a's blocks released first: least recently released
    bm.free(1)
    assert bm.num_evictable_blocks == 4 and bm.num_free_blocks == 6
    bm.allocate(2, 8)  # 2 blocks: the 2 never-cached free blocks go first, nothing evicted
    assert bm.num_evictable_blocks == 4
    bm.allocate(3, 4)  # 1 block: evicts the LRU one - a's *last* full block (released tail first)
    assert bm.block_table(3) == [a_blocks[1]]
    assert bm.cached_prefix_len(10, a + [0]) == 4 and bm.cached_prefix_len(10, b + [0]) == 8
    # taking a cached block back makes it referenced (not evictable); the can_allocate count knows
    assert bm.can_allocate(10, b + [0])  # 2 hits (evictable, revived) + 1 new block from the 3 evictable -> fits
    assert not bm.can_allocate(13, b + [0] * 4)  # 2 hits + 2 new blocks, but only 1 would be left after reviving
    assert bm.allocate(4, 10, b + [0]) == 8
    assert bm.block_table(4)[:2] == b_blocks
    bm.check_invariants()


def test_a_shared_or_registered_block_is_never_written_or_truncated():
    bm = BlockManager(8, BS, enable_prefix_caching=True)
    prompt = list(range(30, 39))
    _registered(bm, 0, prompt)
    bm.allocate(1, 9, prompt)
    with pytest.raises(RuntimeError, match="refusing to write"):
        bm.slot(1, 3)  # shared prefix block
    with pytest.raises(RuntimeError, match="refusing to write"):
        bm.slot(0, 5)  # registered (even while held by its owner alone, after seq 1 leaves)
    assert bm.slot(1, 8) == bm.block_table(1)[2] * BS  # the private tail is writable
    with pytest.raises(ValueError, match="committed prefix blocks"):
        bm.truncate_to(0, 7)
    assert bm.truncate_to(1, 8) == 1  # down to the chained prefix is allowed
    bm.check_invariants()


@settings(max_examples=150, deadline=None)
@given(ops=st.lists(st.tuples(st.sampled_from(["alloc", "commit", "append", "truncate", "free"]), st.integers(0, 4),
                              st.integers(0, 3), st.integers(1, 30)), max_size=60),
       block_size=st.integers(1, 5))
def test_random_prefix_operations_keep_refcounts_and_never_leak(ops, block_size):
    """Prompts from a few families that share prefixes; committed lengths only grow, truncation never goes below
    them, and every block is always referenced, free or evictable - exactly one."""
    families = [[7] * 40, [7] * 10 + [8] * 30, list(range(40)), [7] * 10 + list(range(30))]
    bm = BlockManager(20, block_size, enable_prefix_caching=True)
    live: dict[int, list] = {}  # seq -> [tokens, committed]
    for op, seq, fam, n in ops:
        if op == "alloc" and seq not in live:
            tokens = families[fam][:n]
            if bm.can_allocate(len(tokens), tokens):
                cached = bm.allocate(seq, len(tokens), tokens)
                assert cached % block_size == 0 and cached <= len(tokens) - 1
                live[seq] = [tokens, cached]
        elif op == "commit" and seq in live:
            tokens, committed = live[seq]
            live[seq][1] = committed = max(committed, min(n, bm.seq_len(seq)))
            bm.register_committed(seq, tokens[:committed])
        elif op == "append" and seq in live and bm.can_append(seq, n):
            bm.append_slots(seq, n)
            live[seq][0] = live[seq][0] + [n] * n
        elif op == "truncate" and seq in live:
            bm.truncate_to(seq, max(live[seq][1], bm.num_chained_blocks(seq) * block_size, min(n, bm.seq_len(seq))))
        elif op == "free":
            bm.free(seq)
            live.pop(seq, None)
        bm.check_invariants()
    for seq in list(live):
        bm.free(seq)
    bm.check_invariants()
    assert bm.num_free_blocks == bm.num_blocks


# --- the engine ------------------------------------------------------------------------------------------------
def make_llm(target, cache=True, speculative=None, **kwargs):
    return small_llm(target, dtype="float32", block_size=BS, max_model_len=kwargs.pop("max_model_len", 96),
                       enable_prefix_caching=cache, speculative=speculative, **kwargs)


def count_forward_tokens(llm, monkeypatch) -> list[int]:
    """[tokens fed to the target so far]; counts every new token of every target forward."""
    counter = [0]
    forward = llm.engine.runner.forward

    def counting(items, *args, **kwargs):
        counter[0] += sum(len(it.token_ids) for it in items)
        return forward(items, *args, **kwargs)

    monkeypatch.setattr(llm.engine.runner, "forward", counting)
    return counter


def shared_prompts(n, prefix_len=13, seed=0):
    rng = random.Random(seed)
    prefix = [rng.randrange(1, 257) for _ in range(prefix_len)]
    return [prefix + [rng.randrange(1, 257) for _ in range(rng.randint(1, 7))] for _ in range(n)]


@pytest.fixture(scope="module")
def reference(tiny_pair):
    """Greedy tokens of each prompt, decoded alone without the cache."""
    llm = make_llm(tiny_pair[0], cache=False)
    memo = {}

    def ref(prompt, params=GREEDY):
        key = (tuple(prompt), params.max_tokens)
        if key not in memo:
            memo[key] = llm.generate(prompt_token_ids=[prompt], sampling_params=params)[0].outputs[0].token_ids
        return memo[key]

    return ref


def test_the_second_request_computes_only_what_follows_the_cached_prefix(tiny_pair, reference, monkeypatch):
    llm = make_llm(tiny_pair[0])
    fed = count_forward_tokens(llm, monkeypatch)
    first, second = shared_prompts(2)
    out1 = llm.generate(prompt_token_ids=[first], sampling_params=GREEDY)[0]
    assert fed[0] == len(first) + GREEDY.max_tokens - 1 and out1.metrics["num_cached_tokens"] == 0
    fed[0] = 0
    out2 = llm.generate(prompt_token_ids=[second], sampling_params=GREEDY)[0]
    cached = 12  # the 13-token shared prefix holds 3 full blocks of 4
    assert out2.metrics["num_cached_tokens"] == cached
    assert fed[0] == len(second) - cached + GREEDY.max_tokens - 1  # only the suffix is prefilled
    assert out1.outputs[0].token_ids == reference(first) and out2.outputs[0].token_ids == reference(second)
    stats = llm.engine.stats
    assert stats["prefix_cache_hits"] == cached and stats["prefix_cache_queries"] == len(first) + len(second)
    # the same prompt again: every full block before the last two tokens is cached
    fed[0] = 0
    out3 = llm.generate(prompt_token_ids=[second], sampling_params=GREEDY)[0]
    assert out3.outputs[0].token_ids == reference(second)
    assert fed[0] == len(second) - (len(second) - 2) // BS * BS + GREEDY.max_tokens - 1
    bm = llm.engine.block_manager
    bm.check_invariants()
    assert bm.num_free_blocks == bm.num_blocks and bm.num_evictable_blocks > 0


def test_corrupting_a_cached_block_changes_the_output(tiny_pair, reference):
    """The mutant: the equality checks above can fail - the second request really reads the cached K/V."""
    llm = make_llm(tiny_pair[0])
    first, second = shared_prompts(2)
    llm.generate(prompt_token_ids=[first], sampling_params=GREEDY)
    bm, pool = llm.engine.block_manager, llm.engine.pool
    keys, blocks = bm.prefix_cache.match(second[:12])
    assert len(blocks) == 3
    for b in blocks:
        pool.k[:, b].normal_(generator=torch.Generator().manual_seed(b))
    out = llm.generate(prompt_token_ids=[second], sampling_params=GREEDY)[0]
    assert out.metrics["num_cached_tokens"] == 12
    assert out.outputs[0].token_ids != reference(second)


def test_the_flag_off_computes_everything(tiny_pair, monkeypatch):
    llm = make_llm(tiny_pair[0], cache=False)
    fed = count_forward_tokens(llm, monkeypatch)
    first, second = shared_prompts(2)
    llm.generate(prompt_token_ids=[first, second], sampling_params=GREEDY)
    assert fed[0] == len(first) + len(second) + 2 * (GREEDY.max_tokens - 1)
    assert llm.engine.stats["prefix_cache_hits"] == llm.engine.stats["prefix_cache_queries"] == 0


def test_bad_flag_is_refused(tiny_pair):
    with pytest.raises(ValueError, match="enable_prefix_caching"):
        make_llm(tiny_pair[0], cache="yes")


def test_requests_arriving_together_share_after_the_first_prefill(tiny_pair, reference, monkeypatch):
    """n copies of one prompt added in the same step: the first prefills, the others wait one step for its blocks
    and then compute only the last block (the n > 1 case)."""
    llm = make_llm(tiny_pair[0])
    fed = count_forward_tokens(llm, monkeypatch)
    prompt = shared_prompts(1, prefix_len=17)[0]
    outs = llm.generate(prompt_token_ids=[prompt] * 3 + [prompt[:9] + [5, 6]], sampling_params=GREEDY)
    cached = (len(prompt) - 2) // BS * BS
    assert [o.metrics["num_cached_tokens"] for o in outs] == [0, cached, cached, 8]
    assert fed[0] == len(prompt) + 2 * (len(prompt) - cached) + (11 - 8) + 4 * (GREEDY.max_tokens - 1)
    assert all(o.outputs[0].token_ids == reference(prompt) for o in outs[:3])
    assert outs[3].outputs[0].token_ids == reference(prompt[:9] + [5, 6])


SPEC = {
    "draft_model": lambda d: SpeculativeConfig(method="draft_model", draft_model=d, num_speculative_tokens=3),
    "ngram": lambda d: SpeculativeConfig(method="ngram_table", num_speculative_tokens=4),
}


@pytest.mark.parametrize("method", list(SPEC))
def test_speculation_with_a_shared_prefix_gives_the_plain_tokens(tiny_pair, reference, method, monkeypatch):
    """Rounds roll back across block boundaries (block_size 4, k >= 3) next to shared, registered prefix blocks;
    the draft model's own pool caches nothing and prefills the whole prompt lazily."""
    target, draft = tiny_pair
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    llm = make_llm(target, speculative=SPEC[method](draft), max_num_seqs=3)
    prompts = shared_prompts(6, prefix_len=14, seed=1)
    prompts[3] = prompts[3][:14] + prompts[3][:14]  # repetition for the n-gram drafter
    first = llm.generate(prompt_token_ids=prompts[:1], sampling_params=params)
    outs = first + llm.generate(prompt_token_ids=prompts[1:], sampling_params=params)
    assert [o.outputs[0].token_ids for o in outs] == [reference(p, params) for p in prompts]
    assert all(o.metrics["num_cached_tokens"] == 12 for o in outs[1:])
    assert sum(o.metrics["num_rounds"] for o in outs) > 0
    assert llm.engine.stats["rollback_freed_blocks"] > 0
    for bm in llm.engine.block_managers:
        bm.check_invariants()
        assert bm.num_free_blocks == bm.num_blocks
    for bm in llm.engine.block_managers[1:]:
        assert bm.prefix_cache is None


@pytest.mark.parametrize("speculative", [False, True])
def test_preemption_and_eviction_keep_the_tokens(tiny_pair, reference, speculative):
    """A pool barely above one full-length sequence: requests sharing a prefix preempt each other and evict
    each other's cached blocks; every output still equals its uncached greedy reference."""
    target, draft = tiny_pair
    spec = SPEC["draft_model"](draft) if speculative else None
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    llm = make_llm(target, speculative=spec, max_model_len=40, num_kv_blocks=12, max_num_seqs=4)
    prompts = shared_prompts(8, prefix_len=9, seed=2) + shared_prompts(4, prefix_len=9, seed=3)
    random.Random(4).shuffle(prompts)
    outs = llm.generate(prompt_token_ids=prompts, sampling_params=params)
    assert [o.outputs[0].token_ids for o in outs] == [reference(p, params) for p in prompts]
    assert sum(o.metrics["num_preemptions"] for o in outs) > 0
    assert llm.engine.stats["prefix_cache_hits"] > 0
    bm = llm.engine.block_manager
    bm.check_invariants()
    assert bm.num_free_blocks == bm.num_blocks
    assert llm.engine.stats["prefix_cache_evicted_blocks"] > 0  # the pool cannot keep every prompt's blocks


def test_a_failed_or_aborted_request_leaves_shared_blocks_intact(tiny_pair, reference, monkeypatch):
    """A request that shares a prefix fails in its forward, another is aborted mid-stream: the survivors and a
    later request reading the same cached blocks get their uncached tokens; a rejected request changes nothing."""
    llm = make_llm(tiny_pair[0])
    engine = llm.engine
    prompts = shared_prompts(4, prefix_len=13, seed=5)
    engine.add_request(prompt_token_ids=prompts[0], params=GREEDY, request_id="owner")
    engine.step()  # the owner's prompt is committed; its blocks are registered at the next schedule
    stats = dict(engine.stats)
    with pytest.raises(ValueError):
        engine.add_request(prompt_token_ids=prompts[1] + [10**6], params=GREEDY)
    assert engine.stats == stats
    forward = engine.runner.forward

    def poisoned(items, *args, **kwargs):
        if any(it.seq_id == victim.seq_id for it in items):
            raise RuntimeError("poisoned forward")
        return forward(items, *args, **kwargs)

    engine.add_request(prompt_token_ids=prompts[1], params=GREEDY, request_id="victim")
    engine.add_request(prompt_token_ids=prompts[2], params=GREEDY, request_id="aborted")
    victim = engine._requests["victim"]
    monkeypatch.setattr(engine.runner, "forward", poisoned)
    outputs = {}
    for _ in range(4):
        for out in engine.step():
            outputs[out.request_id] = out
    engine.abort("aborted")
    while engine.has_unfinished_requests():
        for out in engine.step():
            outputs[out.request_id] = out
    assert outputs["victim"].outputs[0].finish_reason == "error"
    assert outputs["victim"].metrics["num_cached_tokens"] == 12
    assert outputs["owner"].outputs[0].token_ids == reference(prompts[0])
    aborted = outputs["aborted"].outputs[0].token_ids
    assert aborted == reference(prompts[2])[: len(aborted)]
    later = llm.generate(prompt_token_ids=[prompts[3]], sampling_params=GREEDY)[0]
    assert later.metrics["num_cached_tokens"] == 12  # the shared 12 tokens: 3 full blocks
    assert later.outputs[0].token_ids == reference(prompts[3])
    engine.block_manager.check_invariants()
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


def test_cli_flag_turns_prefix_caching_off():
    from specdec.cli import build_parser

    for argv in (["generate", "--prompt", "x"], ["serve"]):
        assert build_parser().parse_args(argv).enable_prefix_caching is True
        assert build_parser().parse_args(argv + ["--no-prefix-caching"]).enable_prefix_caching is False


@pytest.mark.parametrize("method", list(SPEC))
def test_a_seeded_sampled_request_draws_the_same_tokens_with_a_cached_prefix(tiny_pair, method):
    """Sampled speculative decoding: a request served partly from the cache gets the tokens of the same seeded
    request on an uncached engine - the admission step stays a prefill (>= 2 tokens), so no step drafts where the
    uncached run did not. Prompt lengths cover every remainder mod block_size (1 + a multiple of 4 included: the
    case where recomputing only the last token would make the admission step a 1-token decode)."""
    target, draft = tiny_pair
    params = SamplingParams(temperature=1.0, max_tokens=10, ignore_eos=True, seed=11)
    cached, uncached = (make_llm(target, cache=c, speculative=SPEC[method](draft)) for c in (True, False))
    rng = random.Random(6)
    base = [rng.randrange(1, 257) for _ in range(16)]
    for n in range(6, 14):
        prompt = base[:n]
        want = uncached.generate(prompt_token_ids=[prompt], sampling_params=params)[0].outputs[0].token_ids
        cached.generate(prompt_token_ids=[prompt + [1]], sampling_params=params)  # caches the prompt's blocks
        out = cached.generate(prompt_token_ids=[prompt], sampling_params=params)[0]
        assert out.metrics["num_cached_tokens"] == (n - 2) // BS * BS > 0
        assert out.outputs[0].token_ids == want, f"prompt length {n}"


def test_n_samples_share_the_prompt_computed_once(tiny_pair, reference, monkeypatch):
    llm = make_llm(tiny_pair[0])
    fed = count_forward_tokens(llm, monkeypatch)
    prompt = shared_prompts(1, prefix_len=18, seed=7)[0]
    cached = (len(prompt) - 2) // BS * BS
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, n=3)
    out = llm.generate(prompt_token_ids=[prompt], sampling_params=params)[0]
    assert fed[0] == len(prompt) + 2 * (len(prompt) - cached) + 3 * (params.max_tokens - 1)
    assert llm.engine.stats["prefix_cache_hits"] == 2 * cached
    assert out.metrics["num_cached_tokens"] == 0  # sample 0's: the request found nothing cached
    assert all(c.token_ids == reference(prompt, params)[:6] for c in out.outputs)
    again = llm.generate(prompt_token_ids=[prompt], sampling_params=params)[0]
    assert again.metrics["num_cached_tokens"] == cached <= again.metrics["num_prompt_tokens"]
