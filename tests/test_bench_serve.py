"""bench/serve.py runs end to end against an in-process server (tiny model) and refuses non-loopback URLs."""

from __future__ import annotations

import json

import pytest
from serve_helpers import ServerThread


def test_bench_serve_against_a_running_server(tmp_path, tmp_path_factory, monkeypatch):
    from tiny_models import make_tiny_model

    import bench.common
    import bench.serve

    folder = str(tmp_path_factory.mktemp("bench_serve_model"))
    make_tiny_model(folder, "llama", seed=5, max_position_embeddings=2048)  # byte tokens: the prompts are long
    monkeypatch.setattr(bench.common, "OUT_DIR", tmp_path)
    server = ServerThread(folder, name="tiny", dtype="float32", max_model_len=2048).start()
    try:
        assert bench.serve.main(["--url", server.base_url, "--concurrency", "1", "2", "--requests-per-level", "2",
                                 "--max-tokens", "3", "--workloads", "shared-system"]) == 0
    finally:
        server.stop()
    [path] = tmp_path.glob("serve-*.json")
    levels = json.loads(path.read_text())["results"]["external"]["shared-system"]
    assert [lv["concurrency"] for lv in levels] == [1, 2]
    for lv in levels:
        assert lv["requests"] == 2 and lv["completion_tokens"] >= 2 and lv["throughput_tok_s"] > 0
        assert lv["ttft_s"]["p50"] > 0


def test_bench_serve_refuses_a_non_loopback_url():
    import bench.serve

    with pytest.raises(SystemExit, match="loopback"):
        bench.serve.main(["--url", "http://10.0.0.1:8000", "--concurrency", "1"])
