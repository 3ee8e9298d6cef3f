"""Model-free drafters on crafted token streams: exact predictions and their tie / window / chaining rules."""

import pytest

from specdec.spec_decode.proposers.ngram_table import NgramTable
from specdec.spec_decode.proposers.prompt_lookup import prompt_lookup


def table(tokens, **kwargs):
    t = NgramTable(**kwargs)
    for tok in tokens:
        t.push(tok)
    return t


def test_ngram_predicts_the_most_frequent_continuation():
    # after 1: 2 twice, 3 once
    assert table([1, 2, 9, 1, 2, 9, 1, 3, 9, 1], min_order=2, max_order=2).predict(1) == [2]


def test_ngram_prefers_the_longest_context():
    # bigram "5 -> 7" is the most frequent overall, but the 4-gram context (1, 2, 5) was followed by 8
    stream = [5, 7, 5, 7, 5, 7, 1, 2, 5, 8, 0, 1, 2, 5]
    assert table(stream).predict(1) == [8]
    assert table(stream, max_order=2).predict(1) == [7]


def test_ngram_ties_go_to_the_most_recent():
    assert table([4, 1, 4, 2, 4]).predict(1) == [2]
    assert table([4, 2, 4, 1, 4]).predict(1) == [1]


def test_ngram_chains_its_own_predictions():
    assert table([1, 2, 3, 4, 1, 2]).predict(3) == [3, 4, 1]


def test_ngram_no_match_means_no_draft():
    assert table([1, 2, 3]).predict(4) == []
    assert table([]).predict(2) == []


def test_window_eviction_changes_the_prediction():
    # context (5, 1): followed by 2 twice early on, by 3 once later. A window that has slid past the early
    # occurrences must forget them (their counts are decremented), so the prediction changes from 2 to 3.
    stream = [5, 1, 2, 5, 1, 2, 9, 5, 1, 3, 9, 9, 9, 9, 5, 1]
    assert table(stream, min_order=3, max_order=3, window=16).predict(1) == [2]
    slid = table(stream, min_order=3, max_order=3, window=9)
    assert list(slid.history) == stream[-9:]
    assert slid.predict(1) == [3]


def test_window_tables_describe_exactly_the_window():
    stream = [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5, 8, 9, 7, 9, 3, 2, 3, 8, 4]
    slid = table(stream, window=8)
    fresh = table(stream[-8:], window=8)
    def counts(t):
        return {n: {c: {k: v[0] for k, v in conts.items()} for c, conts in tab.items()} for n, tab in t.tables.items()}

    assert counts(slid) == counts(fresh)


def test_prompt_lookup_copies_what_followed_the_latest_match():
    tokens = [7, 1, 2, 3, 9, 1, 2, 4, 8, 1, 2]
    assert prompt_lookup(tokens, 3, 1, 4) == [4, 8, 1]  # most recent earlier "1 2" is followed by 4 8 1


def test_prompt_lookup_prefers_longer_suffixes_and_never_matches_itself():
    tokens = [5, 1, 2, 6, 0, 1, 2, 7, 3, 0, 1, 2]
    assert prompt_lookup(tokens, 2, 1, 3) == [7, 3]  # the 3-token match "0 1 2" wins over later "1 2"s
    assert prompt_lookup([1, 2, 3], 2, 1, 3) == []  # the suffix itself is no match
    assert prompt_lookup([4, 4], 3, 1, 2) == [4]  # "4" earlier at 0, followed by 4


def test_prompt_lookup_respects_min_and_max():
    tokens = [1, 2, 3, 0, 3]
    assert prompt_lookup(tokens, 2, 1, 2) == [0, 3]
    assert prompt_lookup(tokens, 2, 2, 2) == []


@pytest.mark.parametrize("kwargs,match", [
    ({"method": "ngram", "draft_model": "x"}, "uses no draft model"),
    ({"method": "ngram", "ngram_min_order": 1}, "n-gram orders"),
    ({"method": "ngram", "ngram_window": 2}, "ngram_window"),
    ({"method": "prompt_lookup", "prompt_lookup_min": 3, "prompt_lookup_max": 2}, "prompt lookup lengths"),
    ({"method": "combined"}, "needs draft_model"),
    ({"method": "combined", "draft_model": "x", "combined_lookup": "regex"}, "combined_lookup 'regex'"),
    ({"method": "ngram", "cost_model": object()}, "only used with adaptive=True"),
])
def test_invalid_model_free_configs(kwargs, match):
    from specdec import SpeculativeConfig

    with pytest.raises(ValueError, match=match):
        SpeculativeConfig(**kwargs)
