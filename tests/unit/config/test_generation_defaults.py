"""The model's sampling defaults from generation_config.json (vLLM's reading), in the LLM, the server's request
parsing and the CLI."""

from __future__ import annotations

import json
import shutil

import pytest
from helpers import small_llm

from specdec.cli import build_parser
from specdec.cli.parser import sampling_params
from specdec.config.generation_defaults import sampling_defaults
from specdec.serve.protocol import parse_chat, parse_completion


def write(folder, config) -> str:
    (folder / "generation_config.json").write_text(json.dumps(config))
    return str(folder)


def test_reads_the_sampling_keys_as_vllm_does(tmp_path):
    path = write(tmp_path, {"do_sample": True, "temperature": 0.6, "top_p": 0.9, "top_k": 20, "min_p": 0.05,
                            "repetition_penalty": 1.1, "max_new_tokens": 64, "num_beams": 1, "eos_token_id": 2})
    assert sampling_defaults(path) == {"temperature": 0.6, "top_p": 0.9, "top_k": 20, "min_p": 0.05,
                                       "repetition_penalty": 1.1, "max_tokens": 64}
    assert sampling_defaults(path, "none") == {}
    assert sampling_defaults(str(tmp_path / "nowhere")) == {}
    with pytest.raises(ValueError, match="generation_config 'vllm' is not supported"):
        sampling_defaults(path, "vllm")
    with pytest.raises(ValueError, match="top_p=2.0 is not a valid sampling default"):
        sampling_defaults(write(tmp_path, {"top_p": 2.0}))
    (tmp_path / "generation_config.json").write_text("{not json")
    with pytest.raises(ValueError, match="is not valid JSON"):
        sampling_defaults(str(tmp_path))


def test_llm_generate_without_params_uses_the_models_defaults(tiny_pair, tmp_path):
    folder = tmp_path / "model"
    shutil.copytree(tiny_pair[0], folder)
    write(folder, {"temperature": 0.0, "max_new_tokens": 5})
    llm = small_llm(str(folder), dtype="float32", max_model_len=64)
    params = llm.get_default_sampling_params()
    assert (params.temperature, params.max_tokens) == (0.0, 5)
    out = llm.generate(prompt_token_ids=[[1, 2, 3]])[0]
    assert len(out.outputs[0].token_ids) <= 5
    assert small_llm(str(folder), dtype="float32", max_model_len=64,
                     generation_config="none").get_default_sampling_params().max_tokens == 16
    with pytest.raises(ValueError, match="generation_config 'x' is not supported"):
        small_llm(str(folder), dtype="float32", max_model_len=64, generation_config="x")
    with pytest.raises(ValueError, match="generation_config 'x' is not supported"):  # before any hub download
        small_llm("nobody/not-a-model", generation_config="x")


def test_server_requests_take_the_defaults_for_fields_they_leave_unset():
    defaults = {"temperature": 0.3, "top_k": 5, "max_tokens": 7}
    req = parse_completion({"model": "m", "prompt": "hi"}, "m", defaults)
    assert (req.params.temperature, req.params.top_k, req.params.max_tokens) == (0.3, 5, 7)
    req = parse_completion({"model": "m", "prompt": "hi", "temperature": 1.0, "max_tokens": 3}, "m", defaults)
    assert (req.params.temperature, req.params.top_k, req.params.max_tokens) == (1.0, 5, 3)
    chat = parse_chat({"model": "m", "messages": [{"role": "user", "content": "hi"}]}, "m", defaults)
    assert chat.params.max_tokens == 7 and not chat.fill_max_tokens  # the model's max_new_tokens, not the context
    plain = parse_chat({"model": "m", "messages": [{"role": "user", "content": "hi"}]}, "m")
    assert plain.fill_max_tokens and plain.params.temperature == 1.0


def test_cli_options_left_at_their_defaults_take_the_models():
    parser = build_parser()
    args = parser.parse_args(["generate", "--prompt", "x"])
    assert sampling_params(args, {"temperature": 0.3, "max_tokens": 9}).temperature == 0.3
    args = parser.parse_args(["generate", "--prompt", "x", "--temperature", "0.5", "--max-tokens", "4"])
    params = sampling_params(args, {"temperature": 0.3, "max_tokens": 9})
    assert (params.temperature, params.max_tokens) == (0.5, 4)
