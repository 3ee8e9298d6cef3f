"""The commands behind ``specdec generate``, ``serve``, ``demo`` and ``convert``: thin calls into the library."""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

from specdec import SamplingParams
from specdec.cli.parser import allowed_origins, api_keys, sampling_params, speculative_config
from specdec.tokenizer.tokenizer import load_chat_template


def convert(args: argparse.Namespace) -> int:
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


def _model_path(model: str | None) -> str:
    """``--model`` as given, or the embedded default model (converted once on first use)."""
    if model is not None:
        return model
    from specdec.checkpoint.default_model import default_model_path

    try:
        return default_model_path()
    except (ModuleNotFoundError, FileNotFoundError) as e:  # the weights package is missing: say how to get it
        raise ValueError(str(e)) from e


def serve(args: argparse.Namespace) -> int:
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
    if args.model_option is not None:  # vLLM's `serve --model M`, beside the positional MODEL
        if args.model is not None and args.model != args.model_option:
            raise ValueError(f"two models given: {args.model!r} (positional) and --model {args.model_option!r}")
        args.model = args.model_option
    if not 0 < args.port < 65536:
        raise ValueError(f"--port must be in [1, 65535], got {args.port}")
    if args.threads:
        torch.set_num_threads(args.threads)
    name = args.served_model_name or args.model or "default"
    origins = allowed_origins(args.allowed_origins)
    signals = run_server(_model_path(args.model), name, args.host, args.port, args.max_waiting,
                         args.shutdown_timeout, speculative, api_key=api_keys(args.api_key), allowed_origins=origins,
                         access_log=args.access_log, request_timeout=args.request_timeout,
                         chat_template=_template_arg(args.chat_template), dtype=args.dtype,
                         device=args.device,
                         max_model_len=args.max_model_len, max_num_seqs=args.max_num_seqs,
                         kv_cache_memory_gb=args.kv_cache_memory_gb, seed=args.seed,
                         enable_prefix_caching=args.enable_prefix_caching, quantization=args.quantization,
                         quantization_group_size=args.quantization_group_size,
                         quantize_lm_head=args.quantize_lm_head, tensor_parallel_size=args.tensor_parallel_size,
                         batch_invariant=_batch_invariant(args), revision=args.revision,
                         generation_config=args.generation_config)
    if signals:  # stopped by a signal that did not surface as KeyboardInterrupt: exit as the shell expects
        print("\ninterrupted", file=sys.stderr)
        return 128 + signals[-1]
    return 0


def _batch_invariant(args: argparse.Namespace) -> bool | None:
    """``--batch-invariant auto | on | off`` as ``LLM(batch_invariant=None | True | False)``."""
    return {"auto": None, "on": True, "off": False}[args.batch_invariant]


def generate(args: argparse.Namespace) -> int:
    import torch

    from specdec import LLM

    params = sampling_params(args)  # before the model load: bad values fail in milliseconds
    speculative = speculative_config(args)
    if args.threads:
        torch.set_num_threads(args.threads)
    llm = LLM(_model_path(args.model), dtype=args.dtype, device=args.device, speculative=speculative,
              enable_prefix_caching=args.enable_prefix_caching, quantization=args.quantization,
              quantization_group_size=args.quantization_group_size, quantize_lm_head=args.quantize_lm_head,
              tensor_parallel_size=args.tensor_parallel_size, batch_invariant=_batch_invariant(args),
              revision=args.revision, generation_config=args.generation_config)
    params = sampling_params(args, llm.engine.config.sampling_defaults)  # the model's defaults where none given
    try:
        return _stream_one(llm, args, params)
    finally:
        llm.shutdown()  # the tensor-parallel workers, if any


def _template_arg(value: str | None) -> str | None:
    """``--chat-template``: a file's text, a template's text, or (neither) a name of the model's named templates."""
    if value is None or os.path.isfile(value) or "{" in value:
        return None if value is None else load_chat_template(value)
    return value


def _chat_template(value: str | None, tokenizer) -> str | None:
    template = _template_arg(value)
    if template is not None and "{" not in template and template not in tokenizer.chat_templates:
        raise ValueError(f"--chat-template {value!r} is neither a file, a Jinja template nor one of the model's "
                         f"named templates {sorted(tokenizer.chat_templates)}")
    return template


def _stream_one(llm, args: argparse.Namespace, params: SamplingParams) -> int:
    import torch

    prompt = args.prompt
    if args.chat:
        if llm.tokenizer is None:
            raise ValueError("--chat needs a model with a tokenizer")
        prompt = llm.tokenizer.apply_chat_template([{"role": "user", "content": prompt}],
                                                   chat_template=_chat_template(args.chat_template, llm.tokenizer))
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


def demo(args) -> int:
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
