"""bench.costs.host_overhead runs end to end on tiny settings (so the benchmark never rots) and reports every mode."""

import json
import math

import pytest

from bench.costs import host_overhead

pytestmark = pytest.mark.bench


def test_host_overhead_runs(tmp_path, monkeypatch):
    import bench.common

    monkeypatch.setattr(bench.common, "OUT_DIR", tmp_path)
    assert host_overhead.main(["--vocab", "64", "--batch", "1", "2", "--steps", "2", "--reps", "1"]) == 0
    data = json.loads((tmp_path / "host_overhead_t1.json").read_text())
    got = {(r["batch"], r["mode"]) for r in data["results"]}
    assert got == {(b, m) for b in (1, 2) for m in host_overhead.MODES}
    assert all(r["ms_per_step"] > 0 for r in data["results"])


def test_host_overhead_static_twins(tmp_path, monkeypatch):
    """--static eager: each selected mode also runs with its uniform batches through the static forward."""
    import bench.common

    monkeypatch.setattr(bench.common, "OUT_DIR", tmp_path)
    assert host_overhead.main(["--vocab", "64", "--batch", "2", "--steps", "2", "--reps", "1", "--modes",
                               "plain greedy", "draft k=4 greedy", "--static", "eager"]) == 0
    data = json.loads((tmp_path / "host_overhead_t1_static_eager.json").read_text())
    assert {r["mode"] for r in data["results"]} == {"plain greedy", "plain greedy [static eager]",
                                                     "draft k=4 greedy", "draft k=4 greedy [static eager]"}
    assert all(0 < r["ms_per_step"] < math.inf for r in data["results"])
