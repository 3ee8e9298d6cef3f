"""bench.dtype.{linear,forward,e2e} run end to end on tiny settings (so the benchmarks never rot) and write their
JSON with the expected keys. e2e and forward get a tiny random llama with a byte tokenizer and chat template."""

import json

import pytest
from tiny_models import make_tiny_model

from bench.dtype import e2e, forward, linear

pytestmark = pytest.mark.bench


@pytest.fixture
def out_dir(tmp_path, monkeypatch):
    import bench.common

    folder = tmp_path / "out"
    monkeypatch.setattr(bench.common, "OUT_DIR", folder)
    return folder


@pytest.fixture(scope="module")
def tiny_target(tmp_path_factory):
    path = tmp_path_factory.mktemp("dtype_tiny") / "tiny"
    make_tiny_model(str(path), max_position_embeddings=1024)
    return str(path)


def test_linear_runs(out_dir):
    assert linear.main(["--shapes", "smol_qkv", "--rows", "1", "5", "--reps", "1", "--work", "1"]) == 0
    data = json.loads((out_dir / "dtype_linear_t1.json").read_text())
    assert {"machine", "threads", "reps", "work", "clock", "results"} <= set(data)
    assert [(r["shape"], r["rows"]) for r in data["results"]] == [("smol_qkv", 1), ("smol_qkv", 5)]
    for r in data["results"]:
        assert set(r["min_ms"]) == set(linear.WAYS) and all(v > 0 for v in r["min_ms"].values())


def test_forward_runs(out_dir, tiny_target):
    argv = ["--target", tiny_target, "--batch", "1", "2", "--new-tokens", "1", "3", "--context", "8", "--reps", "1",
            "--inner", "1"]
    assert forward.main(argv) == 0
    data = json.loads((out_dir / "dtype_forward_tiny_t1.json").read_text())
    assert {"machine", "target", "threads", "context", "reps", "inner", "clock", "fp32_packed", "results"} <= set(data)
    got = {(r["batch"], r["new_tokens"], r["variant"]) for r in data["results"]}
    assert got == {(b, n, v) for b in (1, 2) for n in (1, 3) for v in forward.VARIANTS}
    assert all(r["median_ms"] > 0 and r["vs_decode"] > 0 for r in data["results"])


def test_e2e_runs(out_dir, tiny_target):
    argv = ["--target", tiny_target, "--batch", "1", "2", "--classes", "prose", "--max-tokens", "4", "--reps", "1",
            "--adaptive"]
    assert e2e.main(argv) == 0
    data = json.loads((out_dir / "dtype_e2e_tiny_fp32_bf16_bf16_old_ada.json").read_text())
    assert {"machine", "args", "threads", "clock", "summary", "raw"} <= set(data)
    modes = ("", "/adaptive")
    assert set(data["summary"]) == {f"{b}/prose/{v}{m}" for b in (1, 2) for v in e2e.VARIANTS for m in modes}
    for key, row in data["summary"].items():
        if not key.endswith("/adaptive"):
            assert {"plain_wall", "spec_wall", "plain_cpu", "spec_cpu", "lossless"} <= set(row)
            assert row["plain_cpu"] > 0 and row["spec_cpu"] > 0
    assert len(data["raw"]) == 2 * 3 * 3  # batch x variant x mode
