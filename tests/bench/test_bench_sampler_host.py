"""bench.costs.sampler_host and bench.costs.host_overhead's --penalties / --prompt-len run end to end on tiny
settings."""

import json
import math

import pytest

from bench.costs import host_overhead, sampler_host

pytestmark = pytest.mark.bench


def test_sampler_host_runs(tmp_path, monkeypatch):
    import bench.common

    monkeypatch.setattr(bench.common, "OUT_DIR", tmp_path)
    argv = ["--vocab", "50", "--batch", "1", "3", "--history", "2", "40", "--steps", "2"]
    assert sampler_host.main(argv) == 0
    data = json.loads((tmp_path / "sampler_host_t1.json").read_text())
    got = {(r["batch"], r["history"], r["temperature"], r["penalties"]) for r in data["results"]}
    assert got == {(b, h, t, p) for b in (1, 3) for h in (2, 40) for t in (0.0, 0.8) for p in (False, True)}
    assert all(isinstance(r["ms_per_step"], float) and 0 < r["ms_per_step"] < math.inf for r in data["results"])


def test_host_overhead_with_penalties_and_a_longer_prompt(tmp_path, monkeypatch):
    import bench.common

    monkeypatch.setattr(bench.common, "OUT_DIR", tmp_path)
    argv = ["--vocab", "64", "--batch", "2", "--steps", "2", "--reps", "1", "--penalties", "--prompt-len", "40"]
    assert host_overhead.main(argv) == 0
    data = json.loads((tmp_path / "host_overhead_t1_penalties_p40.json").read_text())
    assert data["penalties"] == host_overhead.PENALTIES and data["prompt_len"] == 40
    assert {r["mode"] for r in data["results"]} == set(host_overhead.MODES)
    assert all(r["ms_per_step"] > 0 for r in data["results"])
