"""bench.costs.draft_vocab_cost runs end to end on a tiny shape (so the benchmark never rots) and reports every
variant."""

import json

import pytest

from bench.costs import draft_vocab_cost

pytestmark = pytest.mark.bench


def test_draft_vocab_cost_runs(tmp_path, monkeypatch):
    import bench.common

    monkeypatch.setattr(bench.common, "OUT_DIR", tmp_path)
    assert draft_vocab_cost.main(["--hidden", "64", "--layers", "1", "--heads", "4", "--kv-heads", "2",
                                  "--intermediate", "128", "--vocab", "512", "--subset", "100", "--batch", "1", "2",
                                  "--context", "16", "--reps", "1"]) == 0
    data = json.loads((tmp_path / "draft_vocab_cost_v512_s100_l1_t1.json").read_text())
    got = {(r["batch"], r["head"], r["mode"]) for r in data["results"]}
    assert got == {(b, h, m) for b in (1, 2) for h in ("full head", "|S| = 100") for m in draft_vocab_cost.MODES}
    sizes = {r["head"]: r["weights_mb"] for r in data["results"]}
    assert sizes["|S| = 100"] < sizes["full head"]  # the cut head holds fewer rows
    assert all(r["ms_per_draft_step"] > 0 for r in data["results"])
