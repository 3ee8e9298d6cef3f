"""The ``specdec`` argument parser - one sub-parser per command, each option next to its help text - and the
library objects built from parsed arguments (``sampling_params``, ``speculative_config``).

The sampling options of ``generate`` take their defaults from the fields of :class:`specdec.SamplingParams`
(and ``--num-speculative-tokens`` from :class:`specdec.SpeculativeConfig`), so the CLI and the Python API
always agree.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os

from specdec import SamplingParams, SpeculativeConfig, __version__
from specdec.config import (
    RECYCLE_SCOPES,
    SUFFIX_SCOPES,
    TREE_POLICIES,
    VERIFY_METHODS,
    parse_tree,
    speculative_config_from_dict,
)
from specdec.config.generation_defaults import GENERATION_CONFIG_MODES
from specdec.training import command as train_command
from specdec.training import vocab_command

# (option, SamplingParams field, type, help). The default comes from the dataclass, never from here.
SAMPLING_OPTIONS = (
    ("--max-tokens", "max_tokens", int, "the most tokens to generate"),
    ("--temperature", "temperature", float, "sampling temperature; 0 = greedy (argmax)"),
    ("--top-k", "top_k", int, "keep the k most likely tokens; 0 = off"),
    ("--top-p", "top_p", float, "nucleus sampling: keep the smallest set with this much probability; 1 = off"),
    ("--min-p", "min_p", float, "drop tokens below min_p times the top token's probability; 0 = off"),
    ("--repetition-penalty", "repetition_penalty", float,
     "divide positive / multiply negative logits of tokens already seen (prompt or output); 1 = off"),
    ("--presence-penalty", "presence_penalty", float,
     "subtract this from the logits of tokens already generated, in [-2, 2]; 0 = off"),
    ("--frequency-penalty", "frequency_penalty", float,
     "subtract this times the count of each token already generated, in [-2, 2]; 0 = off"),
    ("--seed", "seed", int, "seed of the request's randomness (default: drawn from the engine's seed 0, so a "
                            "run repeats)"),
)


def sampling_defaults() -> dict[str, object]:
    """``SamplingParams``' field defaults by field name (only fields with a plain default)."""
    return {f.name: f.default for f in dataclasses.fields(SamplingParams)
            if f.init and f.default is not dataclasses.MISSING}


def _speculative_default(name: str) -> object:
    return next(f.default for f in dataclasses.fields(SpeculativeConfig) if f.name == name)


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Show ``(default: X)`` after every option's help, except where X is None or False (nothing to show)
    or the help text already says what the default is."""

    def _get_help_string(self, action: argparse.Action) -> str:
        if action.default is None or action.default is False or "default" in (action.help or ""):
            return action.help or ""
        return super()._get_help_string(action)


def build_parser() -> argparse.ArgumentParser:
    """The ``specdec`` argument parser (every option documented, defaults shown by ``--help``)."""
    parser = argparse.ArgumentParser(prog="specdec", description="Lossless speculative decoding for Llama models",
                                     formatter_class=_HelpFormatter)
    parser.add_argument("--version", action="version", version=f"specdec {__version__}")
    sub = parser.add_subparsers(dest="command", required=True,
                                metavar="{generate,serve,demo,convert,train-draft,draft-vocab}")
    _generate_parser(sub.add_parser("generate", help="generate text from a prompt", formatter_class=_HelpFormatter,
                                    description="Generate text from a prompt; sampling defaults are "
                                                "specdec.SamplingParams' defaults."))
    _serve_parser(sub.add_parser("serve", help="an OpenAI-compatible HTTP server (completions, chat, metrics)",
                                 formatter_class=_HelpFormatter,
                                 description="Serve a model over an OpenAI-compatible HTTP API (docs/api.md, "
                                             "'Server'); needs the 'serve' extra."))
    _demo_parser(sub.add_parser("demo", help="plain vs speculative (prompt lookup) decoding on a copy-heavy prompt",
                                formatter_class=_HelpFormatter,
                                description="Time the same greedy request plain and with prompt lookup."))
    train_command.add_parser(sub, _HelpFormatter)
    vocab_command.add_parser(sub, _HelpFormatter)
    _convert_parser(sub.add_parser("convert", help="convert a .gguf file into a Hugging Face-style folder, once",
                                   formatter_class=_HelpFormatter,
                                   description="Convert a .gguf file into a Hugging Face-style model folder."))
    return parser


def _generate_parser(gen: argparse.ArgumentParser) -> None:
    gen.add_argument("--model", default=None,
                     help="model folder, .gguf file or hub repo id (default: the embedded SmolLM2-135M-Instruct)")
    gen.add_argument("--prompt", required=True, help="the prompt text")
    gen.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    gen.add_argument("--chat-template", default=None, metavar="FILE|TEMPLATE",
                     help="with --chat: this Jinja template (a file, its text, or a name of the model's named "
                          "templates) instead of the model's")
    _engine_args(gen)
    group = gen.add_argument_group("sampling (defaults: specdec.SamplingParams)")
    defaults = sampling_defaults()
    for option, field, kind, text in SAMPLING_OPTIONS:
        group.add_argument(option, dest=field, type=kind, default=defaults[field], help=text)
    group.add_argument("--stop", action="append", default=None, metavar="TEXT",
                       help="stop when the output contains TEXT (not included in the output); repeatable")
    group.add_argument("--ignore-eos", action="store_true", default=defaults["ignore_eos"],
                       help="keep generating past the end-of-sequence token, up to --max-tokens")
    _speculative_args(gen)


def _engine_args(parser: argparse.ArgumentParser) -> None:
    """Options of the engine shared by ``generate`` and ``serve``."""
    parser.add_argument("--dtype", default="auto", choices=("auto", "float32", "bfloat16", "float16"),
                        help="as LLM(dtype=): auto = the checkpoint's on GPU, the faster one on CPU")
    parser.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"), help="as LLM(device=)")
    parser.add_argument("--threads", type=_positive_int, default=None,
                        help="torch CPU threads (default: torch's choice)")
    parser.add_argument("--no-prefix-caching", dest="enable_prefix_caching", action="store_false",
                        help="as LLM(enable_prefix_caching=False): compute every prompt in full, share no KV blocks")
    parser.add_argument("--quantization", default=None, choices=("int8", "int4", "gguf"),
                        help="as LLM(quantization=): int8 per channel, int4 per group, or gguf (a .gguf model's own "
                             "blocks as stored) (default: none)")
    parser.add_argument("--quantization-group-size", type=_positive_int, default=None,
                        help="as LLM(quantization_group_size=): default int8 per channel, int4 32")
    parser.add_argument("--quantize-lm-head", action="store_true", default=None,
                        help="as LLM(quantize_lm_head=True): quantise the LM head too, a tied one as its own copy")
    parser.add_argument("--batch-invariant", default="auto", choices=("auto", "on", "off"),
                        help="as LLM(batch_invariant=None | True | False): specdec's row-invariant CPU kernels, so "
                             "an answer does not depend on its batch or on speculation (auto: on for bf16 on CPUs "
                             "with AMX); docs/guarantees.md")
    parser.add_argument("--generation-config", default="auto", choices=GENERATION_CONFIG_MODES,
                        help="as LLM(generation_config=): auto = the model's generation_config.json sampling "
                             "defaults (temperature, top_k, top_p, min_p, repetition_penalty, max_new_tokens) for "
                             "what a request leaves unset, as vLLM does; none = SamplingParams' defaults")
    parser.add_argument("--revision", default=None,
                        help="as LLM(revision=): the branch, tag or commit of a hub repo id MODEL (default: its "
                             "default branch); a gated or private repo needs HF_TOKEN")
    parser.add_argument("--tensor-parallel-size", type=_positive_int, default=1,
                        help="as LLM(tensor_parallel_size=): shard the model over N ranks (N - 1 spawned worker "
                             "processes, or torchrun's WORLD_SIZE ranks; gloo on CPU, NCCL on CUDA); "
                             "docs/tensor_parallel.md")


def _serve_parser(serve: argparse.ArgumentParser) -> None:
    serve.add_argument("model", nargs="?", default=None,
                       help="model folder, .gguf file or hub repo id (default: the embedded SmolLM2-135M-Instruct)")
    serve.add_argument("--model", dest="model_option", default=None, metavar="MODEL",
                       help="the model, as vLLM's serve also takes it (instead of the positional MODEL)")
    serve.add_argument("--host", default="127.0.0.1", help="address to listen on")
    serve.add_argument("--port", type=int, default=8000, help="TCP port to listen on")
    serve.add_argument("--served-model-name", default=None,
                       help="the name clients pass as 'model' (default: MODEL as given, or 'default')")
    serve.add_argument("--max-waiting", type=_non_negative_int, default=64,
                       help="requests queued beyond --max-num-seqs; more get HTTP 503 with Retry-After")
    serve.add_argument("--api-key", action="append", default=None,
                       help="require 'Authorization: Bearer KEY' on every route but /health (401 otherwise); repeat "
                            "it for several keys, each its own tenant (the suffix drafter's index is per tenant); "
                            "default: $SPECDEC_API_KEY, else no key")
    serve.add_argument("--allowed-origins", default=None, metavar="JSON|LIST",
                       help="browser origins allowed by CORS: a JSON list or comma-separated ('*': any); default: none")
    serve.add_argument("--access-log", action="store_true", help="log every HTTP request (uvicorn's access log)")
    serve.add_argument("--chat-template", default=None, metavar="FILE|TEMPLATE",
                       help="render chat requests with this Jinja template (a file, its text, or a name of the "
                            "model's named templates) instead of the model's")
    serve.add_argument("--request-timeout", type=float, default=None, metavar="SECONDS",
                       help="abort a request still running after this many seconds (504, or an error event in a "
                            "stream); default: no limit")
    serve.add_argument("--shutdown-timeout", type=float, default=10.0,
                       help="seconds in-flight requests may finish after SIGINT/SIGTERM before they are aborted")
    _engine_args(serve)
    serve.add_argument("--max-model-len", type=_positive_int, default=None,
                       help="longest prompt + output (default: min(the model's limit, 8192))")
    serve.add_argument("--max-num-seqs", type=_positive_int, default=64, help="most sequences decoded together")
    serve.add_argument("--kv-cache-memory-gb", type=float, default=1.0, help="KV-cache pool size in GiB")
    serve.add_argument("--seed", type=int, default=0, help="seeds the per-request seeds of unseeded requests")
    _speculative_args(serve)


def _demo_parser(demo: argparse.ArgumentParser) -> None:
    demo.add_argument("--model", default=None,
                      help="model folder, .gguf file or hub repo id (default: the embedded SmolLM2-135M-Instruct)")
    demo.add_argument("--max-tokens", type=int, default=96, help="tokens generated per run (greedy)")
    demo.add_argument("--threads", type=_positive_int, default=1, help="torch CPU threads")
    demo.add_argument("--dtype", default="float32", help="float32 | bfloat16 | float16 | auto")


def _convert_parser(conv: argparse.ArgumentParser) -> None:
    conv.add_argument("gguf", help="the .gguf file to convert")
    conv.add_argument("out_dir", help="the folder to write (config.json, model.safetensors, tokenizer.json, ...)")
    conv.add_argument("--dtype", default="float32", help="float32 | bfloat16 | float16")
    conv.add_argument("--overwrite", action="store_true", help="replace OUT_DIR if it exists and is not empty")


def _speculative_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("speculative decoding")
    group.add_argument("--speculative-method", default=None,
                       help="draft_model | ngram_table | prompt_lookup | recycle | suffix | pick | combined | eagle3 "
                            "(default: plain decoding)")
    group.add_argument("--draft-model", default=None,
                       help="draft model for draft_model / combined ('self': the target's checkpoint again); the "
                            "EAGLE-3 head for eagle3")
    group.add_argument("--draft-quantization", default=None, choices=("int8", "int4", "gguf"),
                       help="as SpeculativeConfig(draft_quantization=)")
    group.add_argument("--draft-quantize-lm-head", action="store_true", default=None,
                       help="as SpeculativeConfig(draft_quantize_lm_head=True)")
    group.add_argument("--draft-tensor-parallel-size", type=_positive_int, default=None,
                       help="as SpeculativeConfig(draft_tensor_parallel_size=): 1 (the draft on rank 0) or the "
                            "target's --tensor-parallel-size (default)")
    group.add_argument("--draft-vocab", default=None,
                       help="as SpeculativeConfig(draft_vocab=): a file of target token ids (`specdec draft-vocab`'s "
                            ".json, or an EAGLE-3 d2t map); the draft's LM head keeps those rows only")
    group.add_argument("--draft-vocab-size", type=_positive_int, default=None,
                       help="as SpeculativeConfig(draft_vocab_size=): the first N (most frequent) ids of --draft-vocab")
    # default None: an option given without --speculative-method is refused, not silently ignored
    group.add_argument("--num-speculative-tokens", type=int, default=None,
                       help="k, the most tokens drafted per round (default: "
                            f"{_speculative_default('num_speculative_tokens')})")
    group.add_argument("--adaptive", action="store_true", default=None,
                       help="adapt k per request; 0 switches speculation off")
    group.add_argument("--verify", choices=VERIFY_METHODS, default=None,
                       help="verification of sampled draft chains: token-wise or block (Sun et al. 2025) (default: "
                            f"{_speculative_default('verify')})")
    group.add_argument("--tree", default=None,
                       help="draft a token tree: branching factors per depth (e.g. 3,2,1,1) or 'dynamic' "
                            "(default: chains)")
    group.add_argument("--tree-budget", type=int, default=None,
                       help="the most drafted nodes of a dynamic tree (default: "
                            f"{_speculative_default('tree_budget')})")
    group.add_argument("--tree-policy", choices=TREE_POLICIES, default=None,
                       help="measured: tree or chain per round by measured cost (a tree only where it pays); always: "
                            f"a tree every round (default: {_speculative_default('tree_policy')})")
    group.add_argument("--recycle-scope", choices=RECYCLE_SCOPES, default=None,
                       help="method recycle: one candidate matrix for the engine's requests, or one per request "
                            f"(default: {_speculative_default('recycle_scope')})")
    group.add_argument("--suffix-scope", choices=SUFFIX_SCOPES, default=None,
                       help="methods suffix / pick: an index of earlier outputs per tenant (per API key under serve), "
                            f"or one for all (default: {_speculative_default('suffix_scope')})")
    group.add_argument("--suffix-max-tokens", type=_positive_int, default=None,
                       help="methods suffix / pick: tokens of earlier outputs each index keeps (default: "
                            f"{_speculative_default('suffix_max_tokens')})")
    group.add_argument("--speculative-config", default=None, metavar="JSON",
                       help="vLLM's speculative config as JSON, read with vLLM's meanings (its 'ngram' is our "
                            "prompt_lookup; specdec/config/vllm_compat.py), e.g. "
                            "'{\"method\": \"ngram\", \"num_speculative_tokens\": 4}'; instead of the options "
                            "above")


def sampling_params(args: argparse.Namespace, model_defaults: dict | None = None) -> SamplingParams:
    """The request's ``SamplingParams`` from parsed ``generate`` arguments (validated on construction).
    ``model_defaults``: the model's (``EngineConfig.sampling_defaults``), taken for every option left at
    ``SamplingParams``' default (an option given at exactly that value cannot be told apart: ``--generation-config
    none`` keeps the library's defaults)."""
    fields = {field: getattr(args, field) for _, field, _, _ in SAMPLING_OPTIONS}
    library = sampling_defaults()
    for field, value in (model_defaults or {}).items():
        if field in fields and fields[field] == library[field]:
            fields[field] = value
    return SamplingParams(**fields, stop=args.stop, ignore_eos=args.ignore_eos)


# the speculative options and their SpeculativeConfig fields (None when not given on the command line)
_SPECULATIVE_OPTIONS = (
    ("--draft-model", "draft_model"), ("--draft-quantization", "draft_quantization"),
    ("--draft-quantize-lm-head", "draft_quantize_lm_head"),
    ("--draft-tensor-parallel-size", "draft_tensor_parallel_size"), ("--draft-vocab", "draft_vocab"),
    ("--draft-vocab-size", "draft_vocab_size"), ("--num-speculative-tokens", "num_speculative_tokens"),
    ("--adaptive", "adaptive"), ("--verify", "verify"), ("--tree", "tree"), ("--tree-budget", "tree_budget"),
    ("--tree-policy", "tree_policy"), ("--recycle-scope", "recycle_scope"),
    ("--suffix-scope", "suffix_scope"), ("--suffix-max-tokens", "suffix_max_tokens"),
)
_DRAFT_METHODS = "draft_model or combined"
_NEEDS = {"--draft-model": "draft_model, combined or eagle3", "--draft-quantization": _DRAFT_METHODS,
          "--draft-quantize-lm-head": _DRAFT_METHODS, "--draft-tensor-parallel-size": _DRAFT_METHODS,
          "--draft-vocab": _DRAFT_METHODS, "--draft-vocab-size": _DRAFT_METHODS, "--recycle-scope": "recycle or pick",
          "--suffix-scope": "suffix or pick", "--suffix-max-tokens": "suffix or pick"}


def speculative_config(args: argparse.Namespace) -> SpeculativeConfig | None:
    """The ``SpeculativeConfig`` from parsed arguments: from ``--speculative-method`` and the options given, or
    from ``--speculative-config`` (vLLM's JSON); None (plain decoding) with neither. ``ValueError`` for a
    speculative option given without a method (it would be ignored), for both ways at once and for bad JSON."""
    given = {field: getattr(args, field) for _, field in _SPECULATIVE_OPTIONS if getattr(args, field, None) is not None}
    given_flags = [flag for flag, field in _SPECULATIVE_OPTIONS if field in given]
    text = getattr(args, "speculative_config", None)
    if text is not None:
        if args.speculative_method is not None or given:
            also = ["--speculative-method"] * (args.speculative_method is not None) + given_flags
            raise ValueError("--speculative-config replaces --speculative-method and the speculative options; give "
                             f"one or the other (also given: {', '.join(also)})")
        try:
            config = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ValueError(f"--speculative-config is not valid JSON: {exc}") from None
        return speculative_config_from_dict(config)
    if args.speculative_method is None:
        if given:
            flag = given_flags[0]
            raise ValueError(f"{flag} needs --speculative-method {_NEEDS.get(flag, 'METHOD')} (or "
                             "--speculative-config): without one, decoding is plain and the option would be ignored")
        return None
    if "tree" in given:
        given["tree"] = parse_tree(given["tree"])
    return SpeculativeConfig(method=args.speculative_method, **given)


def api_keys(given: list[str] | None) -> list[str] | None:
    """``--api-key`` (repeated: several keys, each its own tenant), else ``$SPECDEC_API_KEY``, else None (no key)."""
    if given:
        return list(given)
    env = os.environ.get("SPECDEC_API_KEY")
    return [env] if env is not None else None


def allowed_origins(text: str | None) -> list[str] | None:
    """``--allowed-origins``: a JSON list (vLLM's form) or a comma-separated list; None when not given."""
    if text is None:
        return None
    if text.lstrip().startswith("["):
        try:
            origins = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ValueError(f"--allowed-origins is not a valid JSON list: {exc}") from None
        if not isinstance(origins, list) or not all(isinstance(o, str) and o for o in origins):
            raise ValueError(f"--allowed-origins must list non-empty strings, got {text!r}")
        return origins
    origins = [o.strip() for o in text.split(",") if o.strip()]
    if not origins:
        raise ValueError("--allowed-origins is empty")
    return origins


def _positive_int(text: str) -> int:
    """argparse type: an integer >= 1."""
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be an integer >= 1, got {value}")
    return value


def _non_negative_int(text: str) -> int:
    """argparse type: an integer >= 0."""
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be an integer >= 0, got {value}")
    return value
