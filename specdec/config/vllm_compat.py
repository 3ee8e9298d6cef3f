"""vLLM's ``speculative_config`` dict -> our :class:`SpeculativeConfig`, with vLLM's meanings.

A config copied from a vLLM deployment (``LLM(speculative_config={...})``, ``specdec serve --speculative-config
JSON``) must run the drafter vLLM would run, never another one silently:

==========================  ==================================================================================
vLLM key                    here
==========================  ==================================================================================
``method: "ngram"``         ``prompt_lookup`` (vLLM's n-gram is prompt lookup; our frequency tables are
                            ``ngram_table``); ``prompt_lookup_min`` / ``max`` default to 5 / 5 as vLLM's do,
                            one given sets the other
``method: "draft_model"``   ``draft_model`` with ``model`` as the draft
``method: "eagle3"``        ``eagle3`` with ``model`` as the head
no ``method``               inferred from ``model`` as vLLM infers it: ``"ngram"`` / ``"[ngram]"`` -> prompt
                            lookup, a name containing ``eagle3`` -> ``eagle3``, another EAGLE -> refused, else
                            ``draft_model``
``num_speculative_tokens``  k (required, as vLLM requires it for every method here)
``draft_tensor_parallel_size``, ``quantization`` (the draft's: ``int8`` / ``int4`` only)
==========================  ==================================================================================

Our own ``SpeculativeConfig`` fields (``adaptive``, ``tree``, ``verify``, ...) may sit in the same dict. Methods
vLLM has and we do not (EAGLE-1, Medusa, MLP speculators, MTP heads) and keys we do not
implement are refused with a ``ValueError`` naming them: a config is never half applied.
"""

from __future__ import annotations

import dataclasses

from specdec.config.speculative import SPECULATIVE_METHODS, SpeculativeConfig

# vLLM's method names that run a drafter of ours, and what they run
VLLM_METHODS = {"ngram": "prompt_lookup", "[ngram]": "prompt_lookup", "draft_model": "draft_model",
                "eagle3": "eagle3"}
VLLM_UNSUPPORTED = ("eagle", "medusa", "mlp_speculator", "mtp", "deepseek_mtp", "ngram_gpu",
                    "custom_class")
VLLM_KEYS = ("method", "model", "num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max",
             "draft_tensor_parallel_size", "quantization")
OUR_KEYS = tuple(f.name for f in dataclasses.fields(SpeculativeConfig)
                 if f.name not in ("method", "draft_model", "draft_quantization", "cost_model"))


def speculative_config_from_dict(config: dict) -> SpeculativeConfig:
    """The :class:`SpeculativeConfig` a vLLM ``speculative_config`` dict means (module docstring); ``ValueError``
    naming an unsupported method, an unknown key or a bad value."""
    if not isinstance(config, dict):
        raise ValueError(f"speculative_config must be a dict or a SpeculativeConfig, got {type(config).__name__}")
    unknown = sorted(set(config) - set(VLLM_KEYS) - set(OUR_KEYS))
    if unknown:
        raise ValueError(f"speculative_config: unsupported key(s) {unknown}; supported: vLLM's {list(VLLM_KEYS)} "
                         f"and SpeculativeConfig's {list(OUR_KEYS)}")
    model = config.get("model")
    method = _method(config.get("method"), model)
    if "num_speculative_tokens" not in config:
        raise ValueError("speculative_config: num_speculative_tokens is required")
    ours = {key: config[key] for key in OUR_KEYS if key in config}
    vllm_ngram = method == "prompt_lookup" and (config.get("method") in ("ngram", "[ngram]")
                                                 or (config.get("method") is None and model in ("ngram", "[ngram]")))
    if method == "prompt_lookup":
        if model not in (None, "ngram", "[ngram]"):
            raise ValueError(f"speculative_config: prompt lookup (vLLM's 'ngram') takes no model, got {model!r}")
        model = None
    if vllm_ngram:  # vLLM's defaults and rule (one bound given sets the other); our own name keeps ours
        low, high = config.get("prompt_lookup_min"), config.get("prompt_lookup_max")
        low, high = (5, 5) if low is None and high is None else (low if low is not None else high,
                                                                 high if high is not None else low)
        ours.update(prompt_lookup_min=low, prompt_lookup_max=high)
    elif method in ("draft_model", "eagle3") and model is None:
        raise ValueError(f"speculative_config: method {method!r} needs 'model' (the draft model or head)")
    quantization = config.get("quantization")
    if quantization is not None and quantization not in ("int8", "int4", "gguf"):
        raise ValueError(f"speculative_config: quantization {quantization!r} is not supported for the draft; "
                         "supported: 'int8', 'int4', 'gguf' (a .gguf draft's own blocks) (or leave it out)")
    return SpeculativeConfig(method=method, draft_model=model, draft_quantization=quantization, **ours)


def _method(method: str | None, model: str | None) -> str:
    """Our method for vLLM's ``method`` (or, without one, the method vLLM infers from ``model``)."""
    if method is None:
        if model is None:
            raise ValueError("speculative_config: give 'method' (e.g. 'ngram', 'draft_model', 'eagle3') or 'model'")
        if model in ("ngram", "[ngram]"):
            return "prompt_lookup"
        lowered = model.lower()
        if "eagle3" in lowered:
            return "eagle3"
        if "eagle" in lowered:
            raise ValueError(f"speculative_config: {model!r} looks like an EAGLE-1/2 head, which is not supported "
                             "(EAGLE-3 heads are: method 'eagle3')")
        return "draft_model"
    if method in VLLM_METHODS:
        return VLLM_METHODS[method]
    if method in SPECULATIVE_METHODS:  # our own names ("prompt_lookup", "ngram_table", "suffix", ...) mean themselves
        return method
    if method in VLLM_UNSUPPORTED or method.endswith("_mtp"):
        raise ValueError(f"speculative_config: vLLM's method {method!r} is not supported here; supported: "
                         f"{sorted(set(VLLM_METHODS) | set(SPECULATIVE_METHODS))}")
    raise ValueError(f"speculative_config: unknown method {method!r}; supported: "
                     f"{sorted(set(VLLM_METHODS) | set(SPECULATIVE_METHODS))}")
