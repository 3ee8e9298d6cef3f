"""Fixtures of the lossless tests: the oracle's tiny target/draft pair (tests/oracle.py), made once per session."""

import pytest
from oracle import make_lossless_pair


@pytest.fixture(scope="session")
def model_dirs(tmp_path_factory) -> tuple[str, str]:
    """(target, draft) folders of the oracle's VOCAB-token pair (a module may define its own, e.g. quantised)."""
    return make_lossless_pair(tmp_path_factory.mktemp("lossless"))
