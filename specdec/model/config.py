"""ModelConfig: the architecture of a Llama-family checkpoint, read from a Hugging Face ``config.json``.

Both dialects are accepted: hub files (``rope_theta``, ``rope_scaling``, ``torch_dtype``) and transformers
5.x files (``rope_parameters``, ``dtype``). Anything we do not implement raises ``ValueError`` naming what is
supported - a silently wrong rope is the worst kind of bug (plausible text, wrong logits).
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from dataclasses import dataclass, field

import torch

from specdec.model.linear import prepack_supported

GGUF_CONVERSION_RECORD = "specdec_conversion.json"  # beside a converted config.json (checkpoint/gguf.py)

SUPPORTED_MODEL_TYPES = ("llama", "qwen2", "qwen3", "mistral")
SUPPORTED_ROPE_TYPES = ("default", "llama3")


@dataclass(frozen=True, slots=True)
class RopeScaling:
    """Llama-3 style rope scaling (``rope_type == "llama3"``)."""

    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position_embeddings: int


@dataclass(frozen=True, slots=True)
class ModelConfig:
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool = False
    qkv_bias: bool = False  # Qwen2 (and llama / qwen3 / mistral with attention_bias): q/k/v projections carry a bias
    o_proj_bias: bool = False  # llama / qwen3 / mistral with attention_bias=True only
    qk_norm: bool = False  # Qwen3: RMSNorm over each head's q and k (weights [head_dim]) before rope
    # attention sees only the last ``sliding_window`` positions (Mistral's sliding_window, Qwen's with
    # use_sliding_window): the engine keeps max_model_len within it, so full attention is exact (config/engine.py)
    sliding_window: int | None = None
    rope_scaling: RopeScaling | None = None
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = field(default_factory=tuple)
    torch_dtype: str | None = None
    # converted from a GGUF file (``specdec_conversion.json`` beside config.json): its float32 weights are
    # dequantised 4-8-bit values, so "auto" may run them in bfloat16 (``resolve_dtype``)
    gguf_source: bool = False

    @classmethod
    def from_json(cls, path: str) -> ModelConfig:
        """Read ``config.json`` at ``path`` (a file, or a directory holding one)."""
        if os.path.isdir(path):
            path = os.path.join(path, "config.json")
        converted = os.path.isfile(os.path.join(os.path.dirname(path), GGUF_CONVERSION_RECORD))
        if not os.path.isfile(path):
            raise ValueError(f"no config.json at {path}")
        with open(path, encoding="utf-8") as f:
            try:
                raw = json.load(f)
            except json.JSONDecodeError as e:
                raise ValueError(f"config.json at {path} is not valid JSON: {e}") from e
        config = cls.from_dict(raw)
        return dataclasses.replace(config, gguf_source=True) if converted else config

    @classmethod
    def from_dict(cls, raw: dict) -> ModelConfig:
        """Build and validate a config from an HF config dict (either dialect)."""
        model_type = raw.get("model_type")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(f"model_type {model_type!r} is not supported; supported: {SUPPORTED_MODEL_TYPES}")
        for key in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads"):
            if not isinstance(raw.get(key), int) or raw[key] < 1:
                raise ValueError(f"config.json needs a positive integer {key!r}, got {raw.get(key)!r}")
        num_heads = raw["num_attention_heads"]
        num_kv_heads = raw.get("num_key_value_heads") or num_heads
        if num_heads % num_kv_heads:
            raise ValueError(f"num_attention_heads ({num_heads}) must be a multiple of num_key_value_heads "
                             f"({num_kv_heads})")
        head_dim = raw.get("head_dim") or raw["hidden_size"] // num_heads
        rope_theta, rope_scaling = _parse_rope(raw)
        llama_bias = model_type in ("llama", "qwen3", "mistral") and bool(raw.get("attention_bias", False))
        if raw.get("mlp_bias"):
            raise ValueError("mlp_bias=True is not supported (Llama-family MLPs here have no bias)")
        act = raw.get("hidden_act", "silu")
        if act != "silu":
            raise ValueError(f"hidden_act {act!r} is not supported; supported: 'silu'")
        eos = raw.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else ((eos,) if isinstance(eos, int) else ())
        return cls(
            model_type=model_type,
            vocab_size=raw["vocab_size"],
            hidden_size=raw["hidden_size"],
            intermediate_size=raw["intermediate_size"],
            num_hidden_layers=raw["num_hidden_layers"],
            num_attention_heads=num_heads,
            num_key_value_heads=num_kv_heads,
            head_dim=head_dim,
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
            rope_theta=rope_theta,
            max_position_embeddings=int(raw.get("max_position_embeddings", 2048)),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            qkv_bias=model_type == "qwen2" or llama_bias,
            o_proj_bias=llama_bias,
            qk_norm=model_type == "qwen3",
            sliding_window=_sliding_window(raw, model_type),
            rope_scaling=rope_scaling,
            bos_token_id=raw.get("bos_token_id"),
            eos_token_ids=eos_ids,
            torch_dtype=raw.get("dtype") or raw.get("torch_dtype"),
        )

    @property
    def position_limit(self) -> int:
        """The longest sequence this model runs exactly here: ``max_position_embeddings``, or its sliding window when
        shorter (within the window, attending the whole context is the window's attention)."""
        if self.sliding_window is None:
            return self.max_position_embeddings
        return min(self.max_position_embeddings, self.sliding_window)

    @property
    def num_params(self) -> int:
        """Parameter count (used for bandwidth figures)."""
        h, i, v = self.hidden_size, self.intermediate_size, self.vocab_size
        q = self.num_attention_heads * self.head_dim
        kv = self.num_key_value_heads * self.head_dim
        per_layer = h * (q + 2 * kv) + q * h + 3 * h * i + 2 * h
        head = 0 if self.tie_word_embeddings else v * h
        return v * h + self.num_hidden_layers * per_layer + h + head


def _sliding_window(raw: dict, model_type: str) -> int | None:
    """The attention window in positions, or None (full attention): Mistral's ``sliding_window``; Qwen2 / Qwen3's
    only with ``use_sliding_window`` (and then on every layer: a ``max_window_layers`` below the layer count -
    windows on some layers only - is refused)."""
    window = raw.get("sliding_window")
    if model_type in ("qwen2", "qwen3"):
        if not raw.get("use_sliding_window", False):
            return None
        if raw.get("max_window_layers", 0) < raw["num_hidden_layers"]:
            raise ValueError(f"use_sliding_window with max_window_layers={raw.get('max_window_layers')} below "
                             f"num_hidden_layers={raw['num_hidden_layers']} (a window on some layers only) is not "
                             "supported")
    elif model_type != "mistral":
        return None
    if window is None:
        return None
    if not isinstance(window, int) or isinstance(window, bool) or window < 1:
        raise ValueError(f"sliding_window must be a positive integer or null, got {window!r}")
    return window


def _parse_rope(raw: dict) -> tuple[float, RopeScaling | None]:
    """(rope_theta, rope_scaling) from either dialect; a missing theta raises instead of defaulting."""
    params = raw.get("rope_parameters")  # transformers 5.x dialect
    scaling = raw.get("rope_scaling")  # hub dialect
    if isinstance(params, dict) and "rope_theta" in params:
        theta = params["rope_theta"]
        scaling = params if params.get("rope_type", "default") != "default" else None
    elif "rope_theta" in raw:
        theta = raw["rope_theta"]
    else:
        raise ValueError("config.json has no rope theta (neither 'rope_theta' nor 'rope_parameters.rope_theta'); "
                         "refusing to guess a default")
    if not isinstance(theta, (int, float)) or not math.isfinite(theta) or theta <= 0:
        raise ValueError(f"rope theta must be a positive number, got {theta!r}")
    if not scaling:
        return float(theta), None
    rope_type = scaling.get("rope_type", scaling.get("type", "default"))
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ValueError(f"rope_type {rope_type!r} is not supported; supported: {SUPPORTED_ROPE_TYPES}")
    if rope_type == "default":
        return float(theta), None
    try:
        return float(theta), RopeScaling(
            factor=float(scaling["factor"]),
            low_freq_factor=float(scaling["low_freq_factor"]),
            high_freq_factor=float(scaling["high_freq_factor"]),
            original_max_position_embeddings=int(scaling["original_max_position_embeddings"]),
        )
    except KeyError as e:
        raise ValueError(f"llama3 rope scaling needs {e.args[0]!r}") from e


DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_dtype(dtype: str | torch.dtype, config: ModelConfig | None = None,
                  device: str | torch.device | None = None) -> torch.dtype:
    """Map a user dtype ("float32" | "bfloat16" | "float16" | "auto" | torch.dtype) to a torch dtype.

    "auto" is the checkpoint's dtype (``config.torch_dtype``; float32 when it has none) on GPU. On CPU it is the
    dtype measured fastest there (docs/benchmarks.md, "CPU dtype policy"):

    - a bfloat16 checkpoint runs in bfloat16 where the CPU has native bf16 (avx512_bf16 or AMX) and torch has
      oneDNN's prepacked linear (``prepack_supported``), which makes bf16 decode and verification faster than
      float32; elsewhere in float32 (emulated bf16 is slower);
    - a float16 checkpoint runs in float32 (an exact upcast; CPU fp16 matmuls are slow, and bf16 would round
      the checkpoint's weights);
    - a GGUF source (``config.gguf_source``: converted to float32 by dequantising 4-8-bit blocks) runs in
      bfloat16 where the CPU has native bf16, like a bf16 checkpoint (1.8x faster decode measured on Qwen2.5 1.5B;
      the dequantised values are rounded to bf16's 8-bit mantissa - docs/guarantees.md), else in float32;
    - a float32 checkpoint, or one with no dtype, runs in float32.

    ``device``: where the model will run (a ``torch.device``, "cpu", "cuda" or "auto"); None or "auto" means
    CUDA when torch sees one, else CPU - the engine's ``device="auto"``. Only "auto" depends on it.
    """
    if isinstance(dtype, torch.dtype):
        if dtype not in DTYPES.values():
            raise ValueError(f"dtype {dtype} is not supported; supported: {list(DTYPES)} or 'auto'")
        return dtype
    if dtype == "auto":
        name = config.torch_dtype if config is not None else None
        checkpoint = DTYPES.get(name, torch.float32)
        if _device_type(device) != "cpu":
            return checkpoint
        return auto_cpu_dtype(torch.bfloat16 if config is not None and config.gguf_source else checkpoint)
    if dtype not in DTYPES:
        raise ValueError(f"dtype {dtype!r} is not supported; supported: {list(DTYPES)} or 'auto'")
    return DTYPES[dtype]


def auto_cpu_dtype(checkpoint: torch.dtype) -> torch.dtype:
    """The CPU half of ``resolve_dtype("auto")``: bfloat16 for a bf16 checkpoint where prepacked bf16 linears
    exist, float32 otherwise."""
    if checkpoint == torch.bfloat16 and prepack_supported(torch.bfloat16, torch.device("cpu")):
        return torch.bfloat16
    return torch.float32


def _device_type(device: str | torch.device | None) -> str:
    if device is None or device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return torch.device(device).type
