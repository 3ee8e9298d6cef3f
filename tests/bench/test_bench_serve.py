"""bench/serving/load.py runs end to end against an in-process server (tiny model) and refuses non-loopback URLs."""

from __future__ import annotations

import json

import pytest
from serve_helpers import ServerThread

pytestmark = pytest.mark.bench


def test_bench_serve_against_a_running_server(tmp_path, tmp_path_factory, monkeypatch):
    from tiny_models import make_tiny_model

    import bench.common
    import bench.serving.load

    folder = str(tmp_path_factory.mktemp("bench_serve_model"))
    make_tiny_model(folder, "llama", seed=5, max_position_embeddings=2048)  # byte tokens: the prompts are long
    monkeypatch.setattr(bench.common, "OUT_DIR", tmp_path)
    server = ServerThread(folder, name="tiny", dtype="float32", max_model_len=2048).start()
    try:
        assert bench.serving.load.main(["--url", server.base_url, "--concurrency", "1", "2", "--requests-per-level",
                                        "2", "--max-tokens", "3", "--workloads", "shared-system"]) == 0
    finally:
        server.stop()
    [path] = tmp_path.glob("serve-*.json")
    levels = json.loads(path.read_text())["results"]["external"]["shared-system"]
    assert [lv["concurrency"] for lv in levels] == [1, 2]
    for lv in levels:
        assert lv["requests"] == 2 and lv["completion_tokens"] >= 2 and lv["throughput_tok_s"] > 0
        assert lv["ttft_s"]["p50"] > 0


def test_bench_serve_refuses_a_non_loopback_url():
    import bench.serving.load

    with pytest.raises(SystemExit, match="loopback"):
        bench.serving.load.main(["--url", "http://10.0.0.1:8000", "--concurrency", "1"])


def test_soak_counts_rejections_apart_from_errors_and_reads_rss(tmp_path_factory):
    import os

    from tiny_models import make_tiny_model

    from bench.serving.soak import soak

    folder = str(tmp_path_factory.mktemp("bench_soak_model"))
    make_tiny_model(folder, "llama", seed=5)
    # capacity 2 (max_num_seqs 2, no waiting room): a burst of 8 at once, 16 tokens each, must see 503s
    server = ServerThread(folder, name="tiny", dtype="float32", max_waiting=0, max_num_seqs=2).start()
    convs = [[{"role": "user", "content": f"hello {i}"}] for i in range(3)]
    try:
        rows = soak(server.base_url, os.getpid(), "tiny", convs, rounds=2, requests=4, concurrency=2, burst=8,
                    max_tokens=16, timeout=120)
    finally:
        server.stop()
    assert [r["round"] for r in rows] == [1, 2]
    for r in rows:
        assert r["errors"] == 0, r["error_messages"]
        assert r["ok"] + r["rejected_503"] == 4 + 8 and r["rejected_503"] >= 1 and r["ok"] >= 4
        assert r["kv_blocks_used_after"] == 0 and r["kv_blocks_total"] > 0
        assert r["rss_after_mib"] > 0 and r["rss_grew_mib"] == r["rss_after_mib"] - r["rss_before_mib"]
    assert rows[1]["rss_before_mib"] == rows[0]["rss_after_mib"]


def test_soak_refuses_a_url_and_bad_sizes():
    import bench.serving.load

    with pytest.raises(SystemExit, match="starts its own server"):
        bench.serving.load.main(["--soak", "2", "--url", "http://127.0.0.1:8000"])
    with pytest.raises(SystemExit, match="--soak-concurrency must be >= 1"):
        bench.serving.load.main(["--soak", "2", "--soak-concurrency", "0"])


def test_server_flags_carry_the_tensor_parallel_size():
    """``--tensor-parallel-size N`` reaches the ``specdec serve`` command line (and the CLI parses it), not for N=1."""
    import argparse

    import bench.serving.load
    from specdec.cli import build_parser

    args = argparse.Namespace(method="prompt_lookup", k=4, tensor_parallel_size=2)
    flags = bench.serving.load.server_flags(args, "adaptive")
    assert flags[-2:] == ["--tensor-parallel-size", "2"]
    assert build_parser().parse_args(["serve", "m", *flags]).tensor_parallel_size == 2
    tp1 = argparse.Namespace(**{**vars(args), "tensor_parallel_size": 1})
    assert "--tensor-parallel-size" not in bench.serving.load.server_flags(tp1, "adaptive")
