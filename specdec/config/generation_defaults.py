"""The model's sampling defaults from its ``generation_config.json``, applied as vLLM applies them.

vLLM (``--generation-config auto``, its default) reads ``temperature``, ``top_k``, ``top_p``, ``min_p``,
``repetition_penalty`` and ``max_new_tokens`` (as ``max_tokens``) from the model's ``generation_config.json`` and
uses them for every field a request leaves unset; other keys (``do_sample``, ``num_beams``, ...) are not read.
``LLM(generation_config="none")`` (vLLM's ``"vllm"``) keeps ``SamplingParams``' own defaults.
"""

from __future__ import annotations

import json
import os

GENERATION_CONFIG_MODES = ("auto", "none")
# generation_config.json key -> SamplingParams field
DEFAULT_FIELDS = {"temperature": "temperature", "top_k": "top_k", "top_p": "top_p", "min_p": "min_p",
                  "repetition_penalty": "repetition_penalty", "max_new_tokens": "max_tokens"}


def sampling_defaults(model_path: str, mode: str = "auto") -> dict:
    """``SamplingParams`` field -> value, from ``model_path``'s ``generation_config.json`` (``mode`` "auto"), or
    ``{}`` (``mode`` "none", or no file). ``ValueError`` for an unknown mode, an unreadable file or a value
    ``SamplingParams`` refuses (naming the file and the key)."""
    from specdec.sampling.params import SamplingParams

    if mode not in GENERATION_CONFIG_MODES:
        raise ValueError(f"generation_config {mode!r} is not supported; supported: {GENERATION_CONFIG_MODES} "
                         "('auto': the model's generation_config.json sampling defaults, 'none': SamplingParams')")
    path = os.path.join(model_path, "generation_config.json")
    if mode == "none" or not os.path.isfile(path):
        return {}
    try:
        with open(path, encoding="utf-8") as f:
            config = json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"{path} is not valid JSON ({e}); pass generation_config='none' to ignore it") from None
    if not isinstance(config, dict):
        raise ValueError(f"{path} must hold a JSON object; pass generation_config='none' to ignore it")
    out = {field: config[key] for key, field in DEFAULT_FIELDS.items() if config.get(key) is not None}
    for field, value in out.items():
        try:
            SamplingParams(**{field: value})
        except (ValueError, TypeError) as e:
            key = next(k for k, f in DEFAULT_FIELDS.items() if f == field)
            raise ValueError(f"{path}: {key}={value!r} is not a valid sampling default ({e}); pass "
                             "generation_config='none' to ignore the file") from None
    return out
