"""bench.projection.quant: bytes per format follow the formats' sizes, a tied head stays bf16 unless quantised,
and the CLI writes its rows."""

from __future__ import annotations

import json

import pytest

from bench.projection.quant import LLAMA_32, main, project, streamed_bytes

pytestmark = pytest.mark.bench


def test_bytes_follow_the_formats():
    cfg = LLAMA_32["Llama-3.2-3B"]
    bf16 = streamed_bytes(cfg, "bf16")
    assert bf16 == pytest.approx(2 * 3.21e9, rel=0.01)  # the published 3.21B parameters, head tied
    assert streamed_bytes(cfg, "int4+head") == pytest.approx(0.375 * bf16)  # 0.75 bytes per weight everywhere
    head = cfg["vocab_size"] * cfg["hidden_size"]
    assert streamed_bytes(cfg, "int4") - streamed_bytes(cfg, "int4+head") == pytest.approx(head * (2 - 0.75))
    assert streamed_bytes(cfg, "int4") < streamed_bytes(cfg, "int8") < bf16
    untied = {**cfg, "tie_word_embeddings": False}
    assert streamed_bytes(untied, "int4") == pytest.approx(streamed_bytes(cfg, "int4+head"))


def test_projection_rows_and_cli(tmp_path, capsys):
    rows = {r["format"]: r for r in project(3350.0, [0.8], 4)}
    assert rows["int4+head"]["target_tok_s_bound"] > rows["bf16"]["target_tok_s_bound"] * 2.5
    assert rows["bf16"]["c"] == pytest.approx(rows["int4+head"]["c"])  # one format for both: the ratio is the sizes'
    out = tmp_path / "p.json"
    assert main(["--alpha", "0.8", "--json", str(out)]) == 0
    assert json.loads(out.read_text())["rows"][0]["format"] == "bf16"
    assert "a bound" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        main(["--alpha", "1.5"])
