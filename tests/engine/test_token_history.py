"""The incremental token history (engine/token_history.py) and the sparse penalty context built from it match the
from-lists constructions they replace, on random histories; appending is the only way a request's tokens change."""

import random
from collections import Counter

import numpy as np
import pytest
import torch

from specdec.engine.sequence import Sequence
from specdec.engine.token_history import TokenHistory
from specdec.kernels.philox import STREAM_SAMPLE
from specdec.sampling.metadata import SamplingMetadata
from specdec.sampling.params import SamplingParams
from specdec.sampling.penalties import penalty_context, penalty_rows, row_counts
from specdec.sampling.probs import SamplingTensors, apply_penalties, apply_penalty_rows
from specdec.sampling.probs import to_probs as standardize
from specdec.sampling.sampler import sample_from_probs, sample_rows


def make_seq(prompt, params=None, seq_id=0):
    return Sequence(seq_id, f"r{seq_id}", None, list(prompt), params or SamplingParams(), 0, frozenset())


def old_penalty_context(prompts, outputs, vocab_size):
    """The from-lists construction this replaces (per row, a dense scatter of every token): the oracle."""
    seen = torch.zeros(len(prompts), vocab_size, dtype=torch.bool)
    counts = torch.zeros(len(prompts), vocab_size, dtype=torch.int32)
    for r, (prompt, out) in enumerate(zip(prompts, outputs)):
        if prompt:
            seen[r, torch.tensor(prompt)] = True
        if out:
            ids = torch.tensor(out, dtype=torch.int64)
            seen[r, ids] = True
            counts[r].index_add_(0, ids, torch.ones_like(ids, dtype=torch.int32))
    return seen, counts


def old_from_params(params):
    def col(attr, dtype):
        return torch.tensor([getattr(p, attr) for p in params], dtype=dtype)

    return [col("temperature", torch.float32), col("top_k", torch.int64), col("top_p", torch.float32),
            col("min_p", torch.float32), col("repetition_penalty", torch.float32),
            col("presence_penalty", torch.float32), col("frequency_penalty", torch.float32)]


def check_history(seq, prompt, output):
    """Every view of ``seq``'s history equals the from-lists one for ``prompt`` + ``output``."""
    full = prompt + output
    assert list(seq.prompt_token_ids) == prompt and list(seq.output_token_ids) == output
    assert seq.all_token_ids == full and seq.num_tokens == len(full)
    assert seq.token_array.dtype == np.int64 and seq.token_array.tolist() == full
    assert seq.history.output_array.tolist() == output
    ids, counts = seq.history.penalty_counts()
    got = dict(zip(ids.tolist(), counts.tolist()))
    assert len(got) == ids.size  # each token once
    out_counts = Counter(output)
    assert got == {t: out_counts.get(t, 0) for t in set(full)}


@pytest.mark.parametrize("seed", range(6))
def test_history_matches_the_lists_through_random_appends(seed):
    rng = random.Random(seed)
    vocab = rng.choice([5, 50, 1000])
    prompt = [rng.randrange(vocab) for _ in range(rng.randrange(1, 40))]
    output: list[int] = []
    seq = make_seq(prompt)
    check_history(seq, prompt, output)
    for _ in range(120):  # one token at a time, past the buffers' initial capacity
        t = rng.randrange(vocab)
        seq.append_token(t)
        output.append(t)
        check_history(seq, prompt, output)


def test_token_lists_are_read_only_and_views_do_not_alias_other_requests():
    a, b = make_seq([1, 2, 3]), make_seq([1, 2, 3], seq_id=1)
    for tokens in (a.all_token_ids, a.output_token_ids, a.prompt_token_ids):
        with pytest.raises(TypeError, match="read-only"):
            tokens.append(4)
        with pytest.raises(TypeError, match="read-only"):
            tokens += [4]
    with pytest.raises(AttributeError):
        a.output_token_ids = [7]  # no setter: a request's tokens only grow through append_token
    with pytest.raises(ValueError):
        a.token_array[0] = 9  # numpy: read-only view
    a.append_token(7)
    assert b.all_token_ids == [1, 2, 3] and a.all_token_ids == [1, 2, 3, 7] and a.output_token_ids == [7]
    snapshot = list(a.all_token_ids)
    a.append_token(8)
    assert snapshot == [1, 2, 3, 7]


def test_penalty_counts_with_drafts_add_the_drafts_to_the_output_counts():
    seq = make_seq([4, 5, 4])
    for t in (5, 6):
        seq.append_token(t)
    ids, counts = seq.penalty_counts([6, 9, 9])
    assert dict(zip(ids.tolist(), counts.tolist())) == {4: 0, 5: 1, 6: 2, 9: 2}
    ids, counts = seq.penalty_counts()
    assert dict(zip(ids.tolist(), counts.tolist())) == {4: 0, 5: 1, 6: 1}  # the drafts were not kept


def random_rows(rng, vocab, num_rows):
    """(prompts, outputs, contexts) per row: a sequence's output, or its output + drafts; the context from its
    history (``Sequence.penalty_counts``), or counted from the lists (``row_counts``)."""
    prompts, outputs, contexts = [], [], []
    for _ in range(num_rows):
        seq = make_seq([rng.randrange(vocab) for _ in range(rng.randrange(1, 30))], seq_id=rng.randrange(99))
        for _ in range(rng.randrange(40)):
            seq.append_token(rng.randrange(vocab))
        drafts = [rng.randrange(vocab) for _ in range(rng.randrange(5))] if rng.random() < 0.5 else []
        prompts.append(list(seq.prompt_token_ids))
        outputs.append(list(seq.output_token_ids) + drafts)
        contexts.append(seq.penalty_counts(drafts) if rng.random() < 0.7 else row_counts(prompts[-1], outputs[-1]))
    return prompts, outputs, contexts


@pytest.mark.parametrize("seed", range(5))
def test_sparse_context_matches_the_dense_from_lists_one(seed):
    rng = random.Random(seed)
    vocab = rng.choice([7, 64, 3000])
    prompts, outputs, contexts = random_rows(rng, vocab, rng.randrange(1, 9))
    want_seen, want_counts = old_penalty_context(prompts, outputs, vocab)
    seen, counts = penalty_context(contexts, vocab, "cpu")
    assert torch.equal(seen, want_seen) and torch.equal(counts, want_counts)
    pr = penalty_rows(contexts, vocab, "cpu")
    pairs = list(zip(pr.rows.tolist(), pr.tokens.tolist()))
    assert len(set(pairs)) == len(pairs)  # each (row, token) once: a plain scatter is exact
    assert seen.sum().item() == len(pairs)


def test_tokens_beyond_the_vocabulary_get_no_entry():
    pr = penalty_rows([row_counts([1, 9, 2], [9, 3, 12]), None], 10, "cpu")
    assert pr.rows.tolist() == [0, 0, 0, 0]  # the row without penalties has none
    assert dict(zip(pr.tokens.tolist(), pr.counts.tolist())) == {1: 0, 2: 0, 3: 1, 9: 1}


@pytest.mark.parametrize("seed", range(5))
def test_sparse_penalties_equal_the_dense_ones_bitwise(seed):
    rng = random.Random(seed)
    vocab = rng.choice([11, 300])
    num_rows = rng.randrange(1, 7)
    prompts, outputs, contexts = random_rows(rng, vocab, num_rows)
    params = [SamplingParams(temperature=rng.choice([0, 0.7, 1.3]), repetition_penalty=rng.choice([1, 0.8, 1.3]),
                             presence_penalty=rng.choice([0, -1.5, 0.4]), frequency_penalty=rng.choice([0, 1.1, -0.3]))
              for _ in range(num_rows)]
    params[0] = SamplingParams(repetition_penalty=1.2)  # at least one penalty
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(num_rows, vocab, generator=gen) * 3
    logits[:, ::5] = 0.0  # zeros: neither branch of the repetition penalty changes them
    st = SamplingTensors.from_params(params, "cpu")
    seen, counts = old_penalty_context(prompts, outputs, vocab)
    want = apply_penalties(logits, seen, counts, st)
    raw = logits.clone()
    pr = penalty_rows([c if p.has_penalties else None for p, c in zip(params, contexts)], vocab, "cpu")
    got = apply_penalty_rows(logits, pr, st)
    assert torch.equal(logits, raw)  # the raw logits (logprobs read them) are untouched
    assert torch.equal(got, want)
    # and the sampler: the same tokens as the from-lists path
    seeds = [rng.randrange(2**63) for _ in range(num_rows)]
    positions = [rng.randrange(5000) for _ in range(num_rows)]
    tokens, _ = sample_rows(logits, params, seeds, positions, contexts, STREAM_SAMPLE)
    probs = standardize(want, st)
    drawn = sample_from_probs(probs, torch.tensor(seeds), torch.tensor(positions), STREAM_SAMPLE)
    assert tokens.tolist() == torch.where(st.temperature == 0, want.argmax(-1), drawn).tolist()


def test_sampling_tensors_are_the_per_column_ones():
    rng = random.Random(3)
    params = [SamplingParams(temperature=rng.random() * 2, top_k=rng.randrange(50), top_p=rng.random() * 0.9 + 0.1,
                             min_p=rng.random() * 0.5, repetition_penalty=rng.random() + 0.5,
                             presence_penalty=rng.random() * 4 - 2, frequency_penalty=rng.random() * 4 - 2)
              for _ in range(9)]
    st = SamplingTensors.from_params(params, "cpu")
    got = [st.temperature, st.top_k, st.top_p, st.min_p, st.repetition_penalty, st.presence_penalty,
           st.frequency_penalty]
    for g, w in zip(got, old_from_params(params)):
        assert g.dtype == w.dtype and torch.equal(g, w) and g.is_contiguous()  # kernels read [R] vectors
    empty = SamplingTensors.from_params([], "cpu")
    assert empty.temperature.shape == (0,) and empty.top_k.shape == (0,)


def test_metadata_checks_row_counts_and_skips_what_greedy_rows_do_not_need():
    greedy = [SamplingParams(temperature=0)] * 2
    contexts = [row_counts([1], []), row_counts([2], [])]
    meta = SamplingMetadata.build(greedy, [1, 2], [3, 4], contexts, 10, "cpu")
    assert meta.seeds is None and meta.penalties is None and meta.num_rows == 2
    with pytest.raises(ValueError, match="positions"):
        SamplingMetadata.build(greedy, [1, 2], [3], contexts, 10, "cpu")


def test_history_grows_past_its_initial_capacity_without_losing_tokens():
    h = TokenHistory(range(3))
    for t in range(1000):
        h.append(t % 37)
    assert h.array.tolist() == list(range(3)) + [t % 37 for t in range(1000)]
    ids, counts = h.penalty_counts([36, 500])
    assert dict(zip(ids.tolist(), counts.tolist()))[500] == 1
