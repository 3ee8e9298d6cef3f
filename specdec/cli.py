"""Command line: ``specdec generate``, ``specdec serve``, ``specdec demo``, ``specdec convert``,
``specdec train-draft`` (specdec/training/command.py) and ``specdec draft-vocab`` (specdec/training/vocab_command.py)
(also ``python -m specdec``).

The sampling options of ``generate`` take their defaults from the fields of :class:`specdec.SamplingParams`
(and ``--num-speculative-tokens`` from :class:`specdec.SpeculativeConfig`), so the CLI and the Python API
always agree. Arguments are validated before any model is loaded: a bad value fails at once with
``error: ...`` and exit code 2; Ctrl-C exits with 130 and no traceback.

Over 300 lines: one argument parser per command, each option next to its help text; the commands themselves
are thin calls into the library.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from pathlib import Path

from specdec import SamplingParams, SpeculativeConfig, __version__
from specdec.config import TREE_POLICIES, VERIFY_METHODS, parse_tree
from specdec.training import command as train_command
from specdec.training import vocab_command

EXIT_USAGE = 2  # bad arguments or input files (argparse's own code)
EXIT_INTERRUPTED = 130  # 128 + SIGINT, what shells report for Ctrl-C

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
    parser.add_argument("--quantization", default=None, choices=("int8", "int4"),
                        help="as LLM(quantization=): int8 per channel or int4 per group (default: none)")
    parser.add_argument("--quantization-group-size", type=_positive_int, default=None,
                        help="as LLM(quantization_group_size=): default int8 per channel, int4 32")
    parser.add_argument("--quantize-lm-head", action="store_true", default=None,
                        help="as LLM(quantize_lm_head=True): quantise the LM head too, a tied one as its own copy")
    parser.add_argument("--tensor-parallel-size", type=_positive_int, default=1,
                        help="as LLM(tensor_parallel_size=): shard the model over N ranks (N - 1 spawned worker "
                             "processes, or torchrun's WORLD_SIZE ranks; gloo on CPU, NCCL on CUDA); "
                             "docs/tensor_parallel.md")


def _serve_parser(serve: argparse.ArgumentParser) -> None:
    serve.add_argument("model", nargs="?", default=None,
                       help="model folder, .gguf file or hub repo id (default: the embedded SmolLM2-135M-Instruct)")
    serve.add_argument("--host", default="127.0.0.1", help="address to listen on")
    serve.add_argument("--port", type=int, default=8000, help="TCP port to listen on")
    serve.add_argument("--served-model-name", default=None,
                       help="the name clients pass as 'model' (default: MODEL as given, or 'default')")
    serve.add_argument("--max-waiting", type=_non_negative_int, default=64,
                       help="requests queued beyond --max-num-seqs; more get HTTP 503 with Retry-After")
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
                       help="draft_model | ngram_table | prompt_lookup | combined | eagle3 (default: plain decoding)")
    group.add_argument("--draft-model", default=None,
                       help="draft model for draft_model / combined ('self': the target's checkpoint again); the "
                            "EAGLE-3 head for eagle3")
    group.add_argument("--draft-quantization", default=None, choices=("int8", "int4"),
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
    group.add_argument("--num-speculative-tokens", type=int, default=_speculative_default("num_speculative_tokens"),
                       help="k, the most tokens drafted per round")
    group.add_argument("--adaptive", action="store_true", help="adapt k per request; 0 switches speculation off")
    group.add_argument("--verify", choices=VERIFY_METHODS, default=_speculative_default("verify"),
                       help="verification of sampled draft chains: token-wise or block (Sun et al. 2025)")
    group.add_argument("--tree", default=None,
                       help="draft a token tree: branching factors per depth (e.g. 3,2,1,1) or 'dynamic' "
                            "(default: chains)")
    group.add_argument("--tree-budget", type=int, default=_speculative_default("tree_budget"),
                       help="the most drafted nodes of a dynamic tree")
    group.add_argument("--tree-policy", choices=TREE_POLICIES, default=_speculative_default("tree_policy"),
                       help="measured: tree or chain per round by measured cost (a tree only where it pays); always: "
                            "a tree every round")


def main(argv: list[str] | None = None) -> int:
    """Run the CLI; returns the exit code (0 ok, 2 bad arguments or input, 130 interrupted)."""
    args = build_parser().parse_args(argv)
    commands = {"generate": _generate, "serve": _serve, "demo": _demo, "convert": _convert,
                "train-draft": train_command.run, "draft-vocab": vocab_command.run}
    try:
        return commands[args.command](args)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        print("\ninterrupted", file=sys.stderr)
        return EXIT_INTERRUPTED


def _convert(args: argparse.Namespace) -> int:
    from specdec.checkpoint.gguf import convert_gguf

    source, out = Path(args.gguf), Path(args.out_dir)
    if not source.is_file():
        raise ValueError(f"{source}: no such file (expected a .gguf file to convert)")
    if out.exists() and not args.overwrite and not _is_empty_dir(out):
        raise ValueError(f"{out} exists; pass --overwrite to replace it")
    if out.exists() and not _is_empty_dir(out) and not (out / "config.json").is_file():
        raise ValueError(f"{out} is not empty and holds no model (no config.json): --overwrite only replaces a "
                         "previous conversion; choose another folder")
    start = time.perf_counter()
    try:
        convert_gguf(source, out, dtype=args.dtype, overwrite=out.exists(), progress=True)
    except OSError as e:  # unreadable source, unwritable destination, disk full: a message, not a traceback
        raise ValueError(f"converting {source} to {out} failed: {e}") from e
    print(f"wrote {out} in {time.perf_counter() - start:.1f} s")
    return 0


def _is_empty_dir(path: Path) -> bool:
    return path.is_dir() and not any(path.iterdir())


def sampling_params(args: argparse.Namespace) -> SamplingParams:
    """The request's ``SamplingParams`` from parsed ``generate`` arguments (validated on construction)."""
    fields = {field: getattr(args, field) for _, field, _, _ in SAMPLING_OPTIONS}
    return SamplingParams(**fields, stop=args.stop, ignore_eos=args.ignore_eos)


def speculative_config(args: argparse.Namespace) -> SpeculativeConfig | None:
    """The ``SpeculativeConfig`` from parsed arguments; None (plain decoding) without --speculative-method."""
    if args.speculative_method is None:
        if args.draft_model is not None:
            raise ValueError("--draft-model needs --speculative-method draft_model, combined or eagle3")
        if getattr(args, "draft_quantization", None) is not None:
            raise ValueError("--draft-quantization needs --speculative-method draft_model or combined")
        if getattr(args, "draft_quantize_lm_head", None) is not None:
            raise ValueError("--draft-quantize-lm-head needs --speculative-method draft_model or combined")
        if getattr(args, "draft_tensor_parallel_size", None) is not None:
            raise ValueError("--draft-tensor-parallel-size needs --speculative-method draft_model or combined")
        if getattr(args, "draft_vocab", None) is not None or getattr(args, "draft_vocab_size", None) is not None:
            raise ValueError("--draft-vocab / --draft-vocab-size need --speculative-method draft_model or combined")
        return None
    return SpeculativeConfig(method=args.speculative_method, draft_model=args.draft_model,
                             num_speculative_tokens=args.num_speculative_tokens, adaptive=args.adaptive,
                             verify=args.verify, tree=parse_tree(args.tree), tree_budget=args.tree_budget,
                             tree_policy=args.tree_policy, draft_quantization=args.draft_quantization,
                             draft_quantize_lm_head=args.draft_quantize_lm_head,
                             draft_tensor_parallel_size=args.draft_tensor_parallel_size,
                             draft_vocab=args.draft_vocab, draft_vocab_size=args.draft_vocab_size)


def _model_path(model: str | None) -> str:
    """``--model`` as given, or the embedded default model (converted once on first use)."""
    if model is not None:
        return model
    from specdec.checkpoint.default_model import default_model_path

    try:
        return default_model_path()
    except (ModuleNotFoundError, FileNotFoundError) as e:  # the weights package is missing: say how to get it
        raise ValueError(str(e)) from e


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


def _serve(args: argparse.Namespace) -> int:
    """``specdec serve``: validate the options, load the model, serve until SIGINT / SIGTERM."""
    try:
        import fastapi  # noqa: F401
        import prometheus_client  # noqa: F401
        import uvicorn  # noqa: F401
    except ModuleNotFoundError as e:
        raise ValueError(f"specdec serve needs the 'serve' extra ({e.name} is missing): "
                         "pip install 'specdec[serve]'") from e
    import torch

    from specdec.serve.server import run_server

    speculative = speculative_config(args)
    if not 0 < args.port < 65536:
        raise ValueError(f"--port must be in [1, 65535], got {args.port}")
    if args.threads:
        torch.set_num_threads(args.threads)
    name = args.served_model_name or args.model or "default"
    signals = run_server(_model_path(args.model), name, args.host, args.port, args.max_waiting,
                         args.shutdown_timeout, speculative, dtype=args.dtype, device=args.device,
                         max_model_len=args.max_model_len, max_num_seqs=args.max_num_seqs,
                         kv_cache_memory_gb=args.kv_cache_memory_gb, seed=args.seed,
                         enable_prefix_caching=args.enable_prefix_caching, quantization=args.quantization,
                         quantization_group_size=args.quantization_group_size,
                         quantize_lm_head=args.quantize_lm_head, tensor_parallel_size=args.tensor_parallel_size)
    if signals:  # stopped by a signal that did not surface as KeyboardInterrupt: exit as the shell expects
        print("\ninterrupted", file=sys.stderr)
        return 128 + signals[-1]
    return 0


def _generate(args: argparse.Namespace) -> int:
    import torch

    from specdec import LLM

    params = sampling_params(args)  # before the model load: bad values fail in milliseconds
    speculative = speculative_config(args)
    if args.threads:
        torch.set_num_threads(args.threads)
    llm = LLM(_model_path(args.model), dtype=args.dtype, device=args.device, speculative=speculative,
              enable_prefix_caching=args.enable_prefix_caching, quantization=args.quantization,
              quantization_group_size=args.quantization_group_size, quantize_lm_head=args.quantize_lm_head,
              tensor_parallel_size=args.tensor_parallel_size)
    try:
        return _stream_one(llm, args, params)
    finally:
        llm.shutdown()  # the tensor-parallel workers, if any


def _stream_one(llm, args: argparse.Namespace, params: SamplingParams) -> int:
    import torch

    prompt = args.prompt
    if args.chat:
        if llm.tokenizer is None:
            raise ValueError("--chat needs a model with a tokenizer")
        prompt = llm.tokenizer.apply_chat_template([{"role": "user", "content": prompt}])
    start = time.perf_counter()
    for delta in llm.stream(prompt, params):
        print(delta, end="", flush=True)
    elapsed = time.perf_counter() - start
    print()
    out = llm.last_stream_output
    _report(out, elapsed, torch.get_num_threads())
    if out is not None and out.outputs[0].finish_reason == "error":
        print(f"error: the request failed: {out.error}", file=sys.stderr)
        return 1
    return 0


def _report(out, elapsed: float, threads: int) -> None:
    """The ``[N tokens in ... s]`` line (and the speculative one) on stderr."""
    n = len(out.outputs[0].token_ids) if out is not None else 0
    print(f"[{n} tokens in {elapsed:.2f} s: {n / elapsed:.1f} tokens/s, {threads} threads, "
          f"finish_reason={out.outputs[0].finish_reason if out else None}]", file=sys.stderr)
    if out is not None and out.metrics.get("num_rounds"):
        m = out.metrics
        print(f"[speculative: acceptance {m['acceptance_rate']:.2f}, alpha {m['alpha']:.2f}, "
              f"{m['mean_tokens_per_round']:.2f} tokens/round over {m['num_rounds']} rounds]", file=sys.stderr)


DEMO_PROMPT = (
    "Rewrite the following Python function so that it uses type hints. Keep everything else exactly the same.\n\n"
    "def merge_intervals(intervals):\n"
    "    intervals = sorted(intervals, key=lambda pair: pair[0])\n"
    "    merged = []\n"
    "    for start, end in intervals:\n"
    "        if merged and start <= merged[-1][1]:\n"
    "            merged[-1][1] = max(merged[-1][1], end)\n"
    "        else:\n"
    "            merged.append([start, end])\n"
    "    return merged\n"
)


def _demo(args) -> int:
    """The README's main job: the same greedy request plain and with prompt lookup, interleaved, timed."""
    import torch

    import specdec

    torch.set_num_threads(args.threads)
    model = _model_path(args.model)
    plain = specdec.LLM(model, dtype=args.dtype)
    spec = specdec.LLM(model, dtype=args.dtype, speculative=specdec.SpeculativeConfig(
        method="prompt_lookup", num_speculative_tokens=6, adaptive=True))
    prompt = plain.tokenizer.apply_chat_template([{"role": "user", "content": DEMO_PROMPT}])
    params = specdec.SamplingParams(temperature=0, max_tokens=args.max_tokens)
    plain.generate(prompt, specdec.SamplingParams(temperature=0, max_tokens=4))  # warm-up, both engines
    spec.generate(prompt, specdec.SamplingParams(temperature=0, max_tokens=4))
    times = {"plain": [], "speculative": []}
    outs = {}
    for _ in range(2):  # interleaved A/B
        for name, llm in (("plain", plain), ("speculative", spec)):
            start = time.perf_counter()
            outs[name] = llm.generate(prompt, params)[0]
            times[name].append(time.perf_counter() - start)
    text = outs["speculative"].outputs[0].text
    same = outs["speculative"].outputs[0].token_ids == outs["plain"].outputs[0].token_ids
    print(text)
    n = {k: len(o.outputs[0].token_ids) for k, o in outs.items()}
    rate = {k: n[k] / min(times[k]) for k in times}
    m = outs["speculative"].metrics
    print(f"\nplain:       {rate['plain']:6.1f} tokens/s")
    print(f"speculative: {rate['speculative']:6.1f} tokens/s (prompt lookup, adaptive k <= 6) -> "
          f"{rate['speculative'] / rate['plain']:.2f}x")
    if m.get("num_rounds"):
        print(f"acceptance {m['acceptance_rate']:.2f}, {m['mean_tokens_per_round']:.2f} tokens per round, "
              f"{m['num_rounds']} rounds; identical tokens to plain greedy: {same}; "
              f"{torch.get_num_threads()} thread(s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
