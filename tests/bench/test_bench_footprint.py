"""bench.memory.footprint runs end to end on a tiny model (so it never rots) and reports what the engine holds."""

import json

import pytest
import torch
from tiny_models import make_tiny_model

from bench.memory import footprint

pytestmark = pytest.mark.bench


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


def test_random_checkpoint_sharded_loads_the_same_tensors_as_unsharded(tmp_path):
    from bench.gpu_steps.models import write_random_llama
    from specdec.checkpoint import loader

    shape = dict(hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=128, vocab_size=300,
                 tie_word_embeddings=False, device="cpu")
    one = write_random_llama(str(tmp_path / "one"), **shape)
    sharded = write_random_llama(str(tmp_path / "sharded"), **shape, shard_bytes=40_000)
    index = json.loads((tmp_path / "sharded" / "model.safetensors.index.json").read_text())
    files = sorted(set(index["weight_map"].values()))
    assert len(files) > 3 and files[0] == f"model-00001-of-{len(files):05d}.safetensors"
    a, b = dict(loader.iter_weights(one)), dict(loader.iter_weights(sharded))
    assert sorted(a) == sorted(b) == sorted(index["weight_map"]) and "lm_head.weight" in a
    for name in a:
        assert torch.equal(a[name], b[name]), name
    with pytest.raises(ValueError, match="shard_bytes"):
        write_random_llama(str(tmp_path / "bad"), **shape, shard_bytes=0)


def test_footprint_random_7b_writes_and_measures_the_checkpoint(out_dir, tmp_path, monkeypatch):
    tiny = dict(hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=128, vocab_size=300,
                tie_word_embeddings=False)
    monkeypatch.setattr(footprint, "RANDOM_7B", tiny)
    monkeypatch.setattr(footprint, "RANDOM_7B_SHARD_BYTES", 40_000)
    folder = tmp_path / "random"
    assert footprint.main(["--random-7b", str(folder), "--dtypes", "bfloat16", "--tokens", "2"]) == 0
    assert (folder / "model.safetensors.index.json").is_file()
    data = json.loads((out_dir / "footprint.json").read_text())
    (run,) = data["results"]
    assert run["model"] == "random-7b" and "error" not in run, run
    assert run["dtype"] == "torch.bfloat16" and run["decode_tok_s"] > 0
    assert data["meta"]["random_7b_shape"] == tiny
