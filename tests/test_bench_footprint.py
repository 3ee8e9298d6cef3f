"""bench.footprint runs end to end on a tiny model (so it never rots) and reports what the engine holds."""

import json

import pytest
from tiny_models import make_tiny_model

from bench import footprint


@pytest.fixture
def out_dir(tmp_path, monkeypatch):
    import bench.common

    folder = tmp_path / "out"
    monkeypatch.setattr(bench.common, "OUT_DIR", folder)
    return folder


def test_footprint_runs_and_counts_the_weights_once(out_dir, tmp_path):
    path = str(tmp_path / "tiny")
    make_tiny_model(path, vocab_size=512, hidden_size=128, intermediate_size=256)
    assert footprint.main(["--models", path, "--dtypes", "float32", "--tokens", "2"]) == 0
    data = json.loads((out_dir / "footprint.json").read_text())
    (run,) = data["results"]
    assert "error" not in run, run
    assert run["dtype"] == "torch.float32" and run["decode_tok_s"] > 0 and run["peak_mib"] >= run["rss_after_mib"]
    # held weights: the parameters once (packed copies replace the plain ones; this model's head is untied)
    assert run["held_weights_mib"] == pytest.approx(run["param_mib"], rel=0.01)
