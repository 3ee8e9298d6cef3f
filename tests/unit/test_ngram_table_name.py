"""Our frequency-table drafter is "ngram_table"; "ngram" (vLLM's name for prompt lookup) still runs it, with a
DeprecationWarning, and is stored under the new name so nothing downstream sees two names."""

from __future__ import annotations

import warnings

import pytest

from specdec.config import MODEL_FREE_LOOKUPS, SPECULATIVE_METHODS, SpeculativeConfig


def _deprecation(**kwargs) -> tuple[SpeculativeConfig, warnings.WarningMessage]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        spec = SpeculativeConfig(**kwargs)
    deprecations = [w for w in caught if issubclass(w.category, DeprecationWarning)]
    assert len(deprecations) == 1, [str(w.message) for w in caught]
    return spec, deprecations[0]


def test_method_ngram_warns_and_is_stored_as_ngram_table():
    spec, warning = _deprecation(method="ngram", ngram_min_order=3, ngram_max_order=5, ngram_window=64)
    assert spec.method == "ngram_table"
    assert (spec.ngram_min_order, spec.ngram_max_order, spec.ngram_window) == (3, 5, 64)  # field names kept
    message = str(warning.message)
    assert "'ngram_table'" in message  # names the new method
    assert "vLLM's 'ngram' is our 'prompt_lookup'" in message
    assert warning.filename == __file__  # points at the caller's line, not at specdec


def test_combined_lookup_ngram_warns_and_is_stored_as_ngram_table():
    spec, warning = _deprecation(method="combined", draft_model="some/draft", combined_lookup="ngram")
    assert spec.method == "combined" and spec.combined_lookup == "ngram_table"
    assert "combined_lookup='ngram'" in str(warning.message) and "'prompt_lookup'" in str(warning.message)
    assert warning.filename == __file__


def test_the_old_name_gives_the_same_config_as_the_new():
    with pytest.warns(DeprecationWarning):
        old = SpeculativeConfig(method="ngram", num_speculative_tokens=3)
    assert old == SpeculativeConfig(method="ngram_table", num_speculative_tokens=3)


@pytest.mark.parametrize("kwargs", [{"method": "ngram_table"}, {"method": "prompt_lookup"},
                                    {"method": "combined", "draft_model": "d", "combined_lookup": "ngram_table"},
                                    {"method": "combined", "draft_model": "d"}])
def test_current_names_do_not_warn(kwargs):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        spec = SpeculativeConfig(**kwargs)
    assert spec.method == kwargs["method"]


def test_only_the_new_name_is_listed():
    assert "ngram_table" in SPECULATIVE_METHODS and "ngram" not in SPECULATIVE_METHODS
    assert MODEL_FREE_LOOKUPS == ("prompt_lookup", "ngram_table")
    with pytest.raises(ValueError, match="ngram_table"):
        SpeculativeConfig(method="ngrams")
