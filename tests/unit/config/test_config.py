"""ModelConfig from both config.json dialects, and the errors for what we do not support."""

import pytest

from specdec.model.config import ModelConfig, resolve_dtype

BASE = dict(model_type="llama", vocab_size=100, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
LLAMA3 = {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 8192}


def test_hub_and_v5_dialects_give_the_same_config():
    hub = ModelConfig.from_dict({**BASE, "rope_theta": 5e5, "rope_scaling": LLAMA3, "torch_dtype": "bfloat16",
                                 "eos_token_id": [1, 2]})
    v5 = ModelConfig.from_dict({**BASE, "rope_parameters": {**LLAMA3, "rope_theta": 5e5}, "dtype": "bfloat16",
                                "eos_token_id": [1, 2]})
    assert hub == v5
    assert hub.rope_theta == 5e5 and hub.rope_scaling.factor == 32.0
    assert hub.eos_token_ids == (1, 2) and hub.torch_dtype == "bfloat16"


def test_eos_as_int_qwen_bias_and_head_dim():
    cfg = ModelConfig.from_dict({**BASE, "model_type": "qwen2", "rope_theta": 1e6, "eos_token_id": 7})
    assert cfg.eos_token_ids == (7,) and cfg.qkv_bias and not cfg.o_proj_bias and cfg.head_dim == 16


def test_llama_attention_bias_flag():
    cfg = ModelConfig.from_dict({**BASE, "rope_theta": 1e4, "attention_bias": True})
    assert cfg.qkv_bias and cfg.o_proj_bias


@pytest.mark.parametrize("change,match", [
    ({"model_type": "gemma"}, "model_type 'gemma' is not supported; supported"),
    ({"rope_theta": None}, "no rope theta"),
    ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "rope_type 'yarn' is not supported"),
    ({"rope_scaling": {"rope_type": "llama3", "factor": 4.0}}, "llama3 rope scaling needs"),
    ({"num_key_value_heads": 3}, "multiple of num_key_value_heads"),
    ({"hidden_act": "gelu"}, "hidden_act 'gelu' is not supported"),
    ({"vocab_size": 0}, "positive integer 'vocab_size'"),
])
def test_unsupported_configs_raise_naming_what_is_supported(change, match):
    raw = {**BASE, "rope_theta": 1e4, **change}
    if raw.get("rope_theta") is None:
        raw.pop("rope_theta")
    with pytest.raises(ValueError, match=match):
        ModelConfig.from_dict(raw)


def test_dtype_names():
    assert str(resolve_dtype("bfloat16")) == "torch.bfloat16"
    with pytest.raises(ValueError, match="dtype 'int8' is not supported"):
        resolve_dtype("int8")
