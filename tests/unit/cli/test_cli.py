"""The CLI: generate (plain and speculative), convert errors, demo on a tiny model; --help, --version,
defaults shared with SamplingParams, validation before the model load, Ctrl-C; where benchmarks write."""

import dataclasses
import subprocess
import sys

import pytest
from tiny_models import make_tiny_model

import specdec
from specdec import cli
from specdec.cli import main


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("cli_model")
    make_tiny_model(str(path), "llama", seed=9)
    return str(path)


def test_generate_prints_text_and_tokens_per_second(model_dir, capsys):
    assert main(["generate", "--model", model_dir, "--prompt", "abc abc abc", "--max-tokens", "6",
                 "--temperature", "0"]) == 0
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


# --- help, version, python -m specdec ------------------------------------------------------------------------


def test_version_prints_the_package_version(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["--version"])
    assert exit_.value.code == 0
    assert capsys.readouterr().out.strip() == f"specdec {specdec.__version__}"


def test_python_dash_m_specdec_runs_the_cli():
    done = subprocess.run([sys.executable, "-m", "specdec", "--help"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "generate" in done.stdout and "convert" in done.stdout and "--version" in done.stdout


@pytest.mark.parametrize("command", ["generate", "demo", "convert"])
def test_every_option_has_help(command):
    sub = next(a for a in cli.build_parser()._actions if isinstance(a, cli.argparse._SubParsersAction))
    for action in sub.choices[command]._actions:
        assert action.help, f"{command} {action.option_strings or action.dest} has no help text"


def test_help_shows_the_defaults(capsys):
    with pytest.raises(SystemExit):
        main(["generate", "--help"])
    out = " ".join(capsys.readouterr().out.split())  # argparse wraps lines
    defaults = cli.sampling_defaults()
    for value in (defaults["temperature"], defaults["max_tokens"], defaults["top_p"], defaults["min_p"]):
        assert f"(default: {value})" in out
    for option in ("--min-p", "--repetition-penalty", "--presence-penalty", "--frequency-penalty", "--stop",
                   "--ignore-eos"):
        assert option in out


# --- one source of truth for sampling defaults; validation before the model load -----------------------------


def test_cli_sampling_defaults_are_the_sampling_params_defaults():
    args = cli.build_parser().parse_args(["generate", "--prompt", "x"])
    api = {f.name: f.default for f in dataclasses.fields(specdec.SamplingParams) if f.init}
    for name in ("temperature", "top_k", "top_p", "min_p", "repetition_penalty", "presence_penalty",
                 "frequency_penalty", "max_tokens", "seed", "stop", "ignore_eos"):
        assert getattr(args, name) == api[name], name
    assert cli.sampling_params(args) == specdec.SamplingParams()
    spec = {f.name: f.default for f in dataclasses.fields(specdec.SpeculativeConfig)}
    with_method = cli.build_parser().parse_args(["generate", "--prompt", "x", "--speculative-method", "prompt_lookup"])
    assert cli.speculative_config(with_method) == specdec.SpeculativeConfig(method="prompt_lookup")
    assert cli.speculative_config(with_method).num_speculative_tokens == spec["num_speculative_tokens"]


def test_new_sampling_options_reach_sampling_params():
    args = cli.build_parser().parse_args([
        "generate", "--prompt", "x", "--min-p", "0.1", "--repetition-penalty", "1.2", "--presence-penalty", "0.5",
        "--frequency-penalty", "-0.5", "--stop", "\n\n", "--stop", "END", "--ignore-eos", "--seed", "7"])
    params = cli.sampling_params(args)
    assert (params.min_p, params.repetition_penalty, params.presence_penalty, params.frequency_penalty) == (
        0.1, 1.2, 0.5, -0.5)
    assert params.stop_strings == ("\n\n", "END") and params.ignore_eos and params.seed == 7


def _no_model_load(monkeypatch):
    def fail(*args, **kwargs):
        raise AssertionError("the model was loaded before the arguments were validated")

    monkeypatch.setattr(specdec, "LLM", fail)


@pytest.mark.parametrize("option, value, field", [
    ("--top-p", "1.5", "top_p"), ("--min-p", "2", "min_p"), ("--repetition-penalty", "0", "repetition_penalty"),
    ("--max-tokens", "0", "max_tokens"), ("--num-speculative-tokens", "0", "num_speculative_tokens"),
])
def test_bad_values_fail_before_the_model_loads(monkeypatch, capsys, tmp_path, option, value, field):
    _no_model_load(monkeypatch)
    argv = ["generate", "--model", str(tmp_path / "no-such-model"), "--prompt", "x", option, value]
    if field == "num_speculative_tokens":
        argv += ["--speculative-method", "prompt_lookup"]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and field in err and "no-such-model" not in err


def test_ctrl_c_exits_130_without_a_traceback(monkeypatch, capsys):
    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(specdec, "LLM", interrupted)
    assert main(["generate", "--model", "whatever", "--prompt", "x"]) == 130
    err = capsys.readouterr().err
    assert "interrupted" in err and "Traceback" not in err


# --- convert ---------------------------------------------------------------------------------------------------


def test_convert_of_a_missing_file_is_a_clear_error(capsys, tmp_path):
    assert main(["convert", str(tmp_path / "absent.gguf"), str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "absent.gguf: no such file" in err
    assert not (tmp_path / "out").exists()


def test_convert_into_an_existing_folder_needs_overwrite(capsys, tmp_path):
    source = tmp_path / "x.gguf"
    source.write_bytes(b"NOPE" + b"\0" * 64)
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    (out / "config.json").write_text("{}")  # a previous conversion: --overwrite may replace it
    assert main(["convert", str(source), str(out)]) == 2
    assert f"error: {out} exists; pass --overwrite to replace it" in capsys.readouterr().err
    assert main(["convert", str(source), str(out), "--overwrite"]) == 2  # gets as far as reading the file
    assert "is not a GGUF file" in capsys.readouterr().err
    assert (out / "keep.txt").read_text() == "mine"  # a failed convert leaves the old folder alone


# --- benchmarks write into bench/out unless --record -----------------------------------------------------------


def test_bench_results_go_to_bench_out_unless_recorded():
    import argparse

    from bench import common

    assert common.results_dir(record=False) == common.BENCH_DIR / "out"
    assert common.results_dir(record=True) == common.BENCH_DIR / "results"
    parser = argparse.ArgumentParser()
    common.add_record_flag(parser)
    assert common.results_dir(parser.parse_args([]).record).name == "out"
    assert common.results_dir(parser.parse_args(["--record"]).record).name == "results"


# --- docs ------------------------------------------------------------------------------------------------------


def test_every_metrics_key_is_documented():
    import re
    from pathlib import Path

    from specdec.engine.sequence import RequestMetrics

    doc = (Path(__file__).resolve().parents[3] / "docs" / "metrics.md").read_text(encoding="utf-8")
    table_keys = {key for row in doc.splitlines() if row.startswith("| `")
                  for key in re.findall(r"`(\w+)`", row.split("|")[1])}
    assert set(RequestMetrics().as_dict()) <= table_keys


def test_dtype_defaults_to_auto_and_bad_threads_or_dtype_fail_before_loading(capsys):
    from specdec import cli

    args = cli.build_parser().parse_args(["generate", "--prompt", "x"])
    assert args.dtype == "auto"
    for argv in (["generate", "--prompt", "x", "--threads", "0"], ["generate", "--prompt", "x", "--dtype", "int8"]):
        with pytest.raises(SystemExit) as exit_info:
            cli.main(argv)
        assert exit_info.value.code == 2


def test_convert_overwrite_never_replaces_a_folder_that_holds_no_model(tmp_path, capsys):
    from specdec import cli

    source = tmp_path / "m.gguf"
    source.write_bytes(b"GGUF")
    folder = tmp_path / "precious"
    folder.mkdir()
    (folder / "notes.txt").write_text("keep me")
    assert cli.main(["convert", str(source), str(folder), "--overwrite"]) == 2
    assert "holds no model" in capsys.readouterr().err
    assert (folder / "notes.txt").read_text() == "keep me"


def test_generate_quantised_with_a_quantised_self_draft(model_dir, capsys):
    assert main(["generate", "--model", model_dir, "--prompt", "ab ab ab", "--max-tokens", "6", "--temperature", "0",
                 "--quantization", "int8", "--speculative-method", "draft_model", "--draft-model", "self",
                 "--draft-quantization", "int4", "--num-speculative-tokens", "2"]) == 0
    assert "tokens/s" in capsys.readouterr().err


def test_quantize_lm_head_flags_reach_the_configs():
    args = cli.build_parser().parse_args(["generate", "--prompt", "x", "--quantization", "int4", "--quantize-lm-head",
                                          "--speculative-method", "draft_model", "--draft-model", "self",
                                          "--draft-quantization", "int4", "--draft-quantize-lm-head"])
    assert args.quantize_lm_head is True
    assert cli.speculative_config(args).draft_quantize_lm_head is True
    args = cli.build_parser().parse_args(["generate", "--prompt", "x"])
    assert args.quantize_lm_head is None


def test_draft_quantization_needs_a_draft_model():
    args = cli.build_parser().parse_args(["generate", "--prompt", "x", "--draft-quantization", "int4"])
    with pytest.raises(ValueError, match="--draft-quantization needs"):
        cli.speculative_config(args)
