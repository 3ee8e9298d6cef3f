"""dtype="auto": the checkpoint's dtype on GPU; on CPU the dtype measured fastest there (docs/benchmarks.md,
"CPU dtype policy"): bf16 checkpoints stay bf16 where the CPU has native bf16 and bf16 linears are prepacked,
everything else runs in float32."""

import pytest
import torch

import specdec.model.config as model_config
from specdec.model.config import ModelConfig, resolve_dtype
from specdec.model.linear import prepack_supported

BASE = {"model_type": "llama", "vocab_size": 32, "hidden_size": 16, "intermediate_size": 32,
        "num_hidden_layers": 1, "num_attention_heads": 2, "rope_theta": 1e4}


def checkpoint(dtype: str | None) -> ModelConfig:
    return ModelConfig.from_dict({**BASE, "torch_dtype": dtype} if dtype else BASE)


@pytest.mark.parametrize("native_bf16", [True, False])
def test_auto_on_cpu(monkeypatch, native_bf16):
    monkeypatch.setattr(model_config, "prepack_supported", lambda dtype, device: native_bf16 or dtype == torch.float32)
    cpu = torch.device("cpu")
    assert resolve_dtype("auto", checkpoint("bfloat16"), cpu) == (torch.bfloat16 if native_bf16 else torch.float32)
    assert resolve_dtype("auto", checkpoint("float16"), "cpu") == torch.float32  # exact upcast, never bf16
    assert resolve_dtype("auto", checkpoint("float32"), "cpu") == torch.float32
    assert resolve_dtype("auto", checkpoint(None), "cpu") == torch.float32
    assert resolve_dtype("auto", None, "cpu") == torch.float32


def test_auto_on_this_cpu_follows_bf16_prepack_support():
    expected = torch.bfloat16 if prepack_supported(torch.bfloat16, torch.device("cpu")) else torch.float32
    assert resolve_dtype("auto", checkpoint("bfloat16"), "cpu") == expected


def test_auto_on_gpu_keeps_the_checkpoint_dtype():
    for name, dtype in model_config.DTYPES.items():
        assert resolve_dtype("auto", checkpoint(name), torch.device("cuda")) == dtype
    assert resolve_dtype("auto", checkpoint(None), "cuda") == torch.float32


def test_default_device_is_the_engines_auto(monkeypatch):
    monkeypatch.setattr(model_config, "prepack_supported", lambda dtype, device: False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert resolve_dtype("auto", checkpoint("float16")) == torch.float16  # GPU: the checkpoint's dtype
    assert resolve_dtype("auto", checkpoint("float16"), "auto") == torch.float16
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert resolve_dtype("auto", checkpoint("float16")) == torch.float32  # CPU
    assert resolve_dtype("auto", checkpoint("bfloat16")) == torch.float32  # CPU without bf16 prepack


def test_explicit_dtypes_ignore_the_device():
    for device in ("cpu", "cuda", None):
        assert resolve_dtype("bfloat16", checkpoint("float32"), device) == torch.bfloat16
        assert resolve_dtype("float16", checkpoint("bfloat16"), device) == torch.float16
        assert resolve_dtype(torch.float32, checkpoint("bfloat16"), device) == torch.float32
    with pytest.raises(ValueError, match="not supported"):
        resolve_dtype("int8", None, "cpu")
