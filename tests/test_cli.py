"""The CLI: generate (plain and speculative), convert errors, demo on a tiny model."""

import pytest
from tiny_models import make_tiny_model

from specdec.cli import main


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("cli_model")
    make_tiny_model(str(path), "llama", seed=9)
    return str(path)


def test_generate_prints_text_and_tokens_per_second(model_dir, capsys):
    assert main(["generate", "--model", model_dir, "--prompt", "abc abc abc", "--max-tokens", "6"]) == 0
    out = capsys.readouterr()
    assert "tokens/s" in out.err and "finish_reason=length" in out.err


def test_generate_speculative_prints_acceptance(model_dir, capsys):
    assert main(["generate", "--model", model_dir, "--prompt", "ab ab ab ab ab ab", "--max-tokens", "12",
                 "--speculative-method", "prompt_lookup", "--num-speculative-tokens", "3"]) == 0
    err = capsys.readouterr().err
    assert "tokens/s" in err


def test_chat_flag_uses_the_template(model_dir, capsys):
    assert main(["generate", "--model", model_dir, "--prompt", "hi", "--chat", "--max-tokens", "3"]) == 0


def test_bad_arguments_are_reported_not_raised(model_dir, capsys, tmp_path):
    assert main(["generate", "--model", model_dir, "--prompt", "x", "--temperature", "-1"]) == 2
    assert "temperature" in capsys.readouterr().err
    assert main(["generate", "--model", model_dir, "--prompt", "x", "--draft-model", model_dir]) == 2
    bogus = tmp_path / "x.gguf"
    bogus.write_bytes(b"NOPE" + b"\0" * 64)
    assert main(["convert", str(bogus), str(tmp_path / "out")]) == 2
    assert "error:" in capsys.readouterr().err


def test_demo_runs_plain_and_speculative(model_dir, capsys):
    assert main(["demo", "--model", model_dir, "--max-tokens", "8"]) == 0
    out = capsys.readouterr().out
    assert "plain:" in out and "speculative:" in out
