"""bench.projection.speculative: the roofline parameter count, the GPU cost reader and the table over the recorded
CPU runs."""

import json

import pytest

from bench.projection import speculative as projection
from bench.speed.e2e import improvement

pytestmark = pytest.mark.bench


def test_streamed_parameters_match_published_llama_3_2_sizes():
    # Meta's model cards: 1.24B and 3.21B parameters (tied embeddings; norms are the only ones left out here)
    assert projection.streamed_parameters(projection.LLAMA_3_2["1B"]) == pytest.approx(1.236e9, rel=2e-3)
    assert projection.streamed_parameters(projection.LLAMA_3_2["3B"]) == pytest.approx(3.213e9, rel=2e-3)


def test_tied_and_untied_heads_stream_the_same_bytes():
    tied = dict(projection.LLAMA_3_2["1B"])
    # the input embedding is a lookup (one row per token) whether tied or not: only the head is streamed
    assert projection.streamed_parameters({**tied, "tie_word_embeddings": False}) == \
        projection.streamed_parameters(tied)


def test_gpu_costs_reads_bench_gpu_e2e_and_interpolates_v():
    e2e = {"k": 4, "device": "NVIDIA H100", "pairs": {"random": {"batches": {"1": {"costs": {"c": 0.41, "v_k": 1.2}}}}}}
    costs = projection.gpu_costs(e2e)
    assert costs["c"] == 0.41 and costs["v"] == pytest.approx([1.05, 1.1, 1.15, 1.2])
    assert projection.gpu_costs({"pairs": {}}) is None


def test_table_over_recorded_runs(tmp_path, capsys, monkeypatch):
    # what a new machine sees: an empty cache (the recorded results name model folders under /root/.cache that
    # exist only where the models were converted) - the recorded results and KNOWN_CONFIGS must be enough
    monkeypatch.setenv("SPECDEC_CACHE", str(tmp_path / "empty_cache"))
    monkeypatch.setattr(projection, "read_config", lambda path: pytest.fail(f"read {path}/config.json"))
    out = tmp_path / "rows.json"
    assert projection.main(["--json", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert {r["class"] for r in rows} >= {"code", "copy", "prose"}
    qwen_c = (projection.streamed_parameters(projection.KNOWN_CONFIGS["Qwen2.5-Coder-0.5B-Instruct"])
              / projection.streamed_parameters(projection.KNOWN_CONFIGS["Qwen2.5-Coder-1.5B-Instruct"]))
    assert qwen_c == pytest.approx(0.320, abs=5e-4)  # docs/benchmarks.md, "Projection to a GPU"
    for r in rows:
        assert r["predicted_thm_v_k"] == pytest.approx(improvement(r["alpha"], r["k"], r["c"], r["v_k"]))
        assert r["c"] == (0.0 if "prompt_lookup" in r["run"] else pytest.approx(qwen_c))
    assert "| measured on GPU |" in capsys.readouterr().out


def test_model_sizes_come_from_the_result_then_known_configs_then_the_folder(tmp_path):
    known = projection.KNOWN_CONFIGS["Qwen2.5-Coder-0.5B-Instruct"]
    recorded = dict(projection.LLAMA_3_2["1B"])
    missing = str(tmp_path / "nowhere" / "Qwen2.5-Coder-0.5B-Instruct")
    assert projection.model_config({"draft": missing}, "draft") == known
    assert projection.model_config({"draft": missing, "draft_config": recorded}, "draft") == recorded
    assert projection.model_config({"draft": None}, "draft") is None  # a model-free drafter
    folder = tmp_path / "my-model"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(recorded))
    assert projection.model_config({"target": str(folder)}, "target") == recorded
    with pytest.raises(ValueError, match="no sizes for the draft model"):
        projection.model_config({"draft": str(tmp_path / "unknown-model")}, "draft")
