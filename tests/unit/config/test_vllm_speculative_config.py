"""vLLM's ``speculative_config`` dict read with vLLM's meanings (specdec/config/vllm_compat.py): its "ngram" runs
prompt lookup, never our frequency tables; methods and keys we lack are refused by name; ``LLM(speculative_config=)``
and the CLI's ``--speculative-config`` reach the engine; speculative options without a method are refused."""

from __future__ import annotations

import json

import pytest
from helpers import small_llm

from specdec import SpeculativeConfig
from specdec.cli import build_parser
from specdec.cli.parser import speculative_config
from specdec.config import speculative_config_from_dict
from specdec.spec_decode.proposers.ngram_table import NgramTableProposer
from specdec.spec_decode.proposers.prompt_lookup import PromptLookupProposer


@pytest.mark.parametrize("config,expected", [
    ({"method": "ngram", "num_speculative_tokens": 4},
     {"method": "prompt_lookup", "prompt_lookup_min": 5, "prompt_lookup_max": 5, "num_speculative_tokens": 4}),
    ({"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3},
     {"method": "prompt_lookup", "prompt_lookup_min": 3, "prompt_lookup_max": 3}),
    ({"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 2},
     {"method": "prompt_lookup", "prompt_lookup_min": 2, "prompt_lookup_max": 2}),
    ({"model": "[ngram]", "num_speculative_tokens": 2, "prompt_lookup_min": 1, "prompt_lookup_max": 4},
     {"method": "prompt_lookup", "draft_model": None, "prompt_lookup_min": 1, "prompt_lookup_max": 4}),
    ({"model": "org/Llama-3.2-1B", "num_speculative_tokens": 5},
     {"method": "draft_model", "draft_model": "org/Llama-3.2-1B"}),
    ({"method": "draft_model", "model": "d", "num_speculative_tokens": 2, "draft_tensor_parallel_size": 1,
      "quantization": "int4"},
     {"method": "draft_model", "draft_tensor_parallel_size": 1, "draft_quantization": "int4"}),
    ({"model": "yuhuili/EAGLE3-LLaMA3.1-Instruct-8B", "num_speculative_tokens": 3}, {"method": "eagle3"}),
    ({"method": "prompt_lookup", "num_speculative_tokens": 4, "adaptive": True, "tree": "dynamic"},
     {"method": "prompt_lookup", "adaptive": True, "tree": "dynamic", "prompt_lookup_min": 2,
      "prompt_lookup_max": 4}),  # our own method name keeps our defaults
    ({"method": "ngram_table", "num_speculative_tokens": 4}, {"method": "ngram_table"}),
])
def test_vllm_keys_mean_what_they_mean_in_vllm(config, expected):
    spec = speculative_config_from_dict(config)
    for field, value in expected.items():
        assert getattr(spec, field) == value, field


@pytest.mark.parametrize("config,message", [
    ({"method": "eagle", "model": "m", "num_speculative_tokens": 3}, "vLLM's method 'eagle' is not supported"),
    ({"method": "medusa", "model": "m", "num_speculative_tokens": 3}, "'medusa' is not supported"),
    ({"method": "deepseek_mtp", "num_speculative_tokens": 1}, "'deepseek_mtp' is not supported"),
    ({"method": "nonsense", "num_speculative_tokens": 1}, "unknown method 'nonsense'"),
    ({"model": "yuhuili/EAGLE-LLaMA3-Instruct-8B", "num_speculative_tokens": 3}, "EAGLE-1/2 head"),
    ({"method": "ngram"}, "num_speculative_tokens is required"),
    ({"num_speculative_tokens": 3}, "give 'method'"),
    ({"method": "draft_model", "num_speculative_tokens": 3}, "needs 'model'"),
    ({"method": "ngram", "model": "org/m", "num_speculative_tokens": 3}, "takes no model"),
    ({"method": "ngram", "num_speculative_tokens": 3, "disable_by_batch_size": 4},
     r"unsupported key\(s\) \['disable_by"),
    ({"method": "draft_model", "model": "d", "num_speculative_tokens": 3, "quantization": "fp8"}, "quantization 'fp8'"),
    ({"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 4, "prompt_lookup_max": 2}, "prompt_lookup"),
    ([("method", "ngram")], "must be a dict"),
])
def test_what_is_not_supported_is_refused_by_name(config, message):
    with pytest.raises(ValueError, match=message):
        speculative_config_from_dict(config)


def test_llm_speculative_config_dict_runs_prompt_lookup_where_vllm_would(tiny_pair):
    llm = small_llm(tiny_pair[0], speculative_config={"method": "ngram", "num_speculative_tokens": 3,
                                                      "prompt_lookup_max": 2})
    proposer = llm.engine.speculative.proposer
    assert isinstance(proposer, PromptLookupProposer) and not isinstance(proposer, NgramTableProposer)
    assert (proposer.min_ngram, proposer.max_ngram) == (2, 2)
    assert llm.engine.speculative.policy.k_max == 3


def test_llm_takes_one_of_speculative_and_speculative_config(tiny_pair):
    with pytest.raises(ValueError, match="not both"):
        small_llm(tiny_pair[0], speculative=SpeculativeConfig(method="prompt_lookup"),
                  speculative_config={"method": "ngram", "num_speculative_tokens": 3})


def parse(*argv):
    return build_parser().parse_args(list(argv))


def test_cli_speculative_config_json():
    spec = speculative_config(parse("generate", "--prompt", "x", "--speculative-config",
                                    json.dumps({"method": "ngram", "num_speculative_tokens": 4})))
    assert spec.method == "prompt_lookup" and spec.num_speculative_tokens == 4
    with pytest.raises(ValueError, match="not valid JSON"):
        speculative_config(parse("generate", "--prompt", "x", "--speculative-config", "{method: ngram}"))
    with pytest.raises(ValueError, match="replaces --speculative-method"):
        speculative_config(parse("generate", "--prompt", "x", "--speculative-config", '{"method": "ngram"}',
                                 "--num-speculative-tokens", "3"))
    serve = parse("serve", "--speculative-config", '{"method": "ngram", "num_speculative_tokens": 2}')
    assert speculative_config(serve).method == "prompt_lookup"


@pytest.mark.parametrize("argv,flag", [
    (["--num-speculative-tokens", "3"], "--num-speculative-tokens needs --speculative-method"),
    (["--adaptive"], "--adaptive needs --speculative-method"),
    (["--tree", "2,1"], "--tree needs --speculative-method"),
    (["--verify", "block"], "--verify needs --speculative-method"),
    (["--tree-policy", "always"], "--tree-policy needs --speculative-method"),
    (["--draft-model", "d"], "--draft-model needs --speculative-method draft_model, combined or eagle3"),
])
def test_speculative_options_without_a_method_are_refused_not_ignored(argv, flag):
    with pytest.raises(ValueError, match=flag):
        speculative_config(parse("generate", "--prompt", "x", *argv))
    assert speculative_config(parse("generate", "--prompt", "x")) is None  # nothing given: plain decoding


def test_options_given_with_a_method_reach_the_config():
    spec = speculative_config(parse("generate", "--prompt", "x", "--speculative-method", "draft_model",
                                    "--draft-model", "d", "--num-speculative-tokens", "3", "--adaptive",
                                    "--tree", "2,1", "--verify", "block"))
    assert (spec.draft_model, spec.num_speculative_tokens, spec.adaptive, spec.tree, spec.verify) == (
        "d", 3, True, [2, 1], "block")


def test_serve_takes_model_as_an_option_too():
    args = parse("serve", "--model", "some/folder")
    assert args.model_option == "some/folder" and args.model is None
    assert parse("serve", "pos").model == "pos"
