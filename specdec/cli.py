"""Command line: ``specdec generate`` and ``specdec convert``."""

from __future__ import annotations

import argparse
import sys
import time


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="specdec", description="Lossless speculative decoding for Llama models")
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="generate text from a prompt")
    gen.add_argument("--model", default=None,
                     help="model folder, .gguf file or hub repo id (default: the embedded SmolLM2-135M-Instruct)")
    gen.add_argument("--prompt", required=True)
    gen.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    gen.add_argument("--max-tokens", type=int, default=128)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--top-k", type=int, default=0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--seed", type=int, default=None)
    gen.add_argument("--dtype", default="float32", help="float32 | bfloat16 | float16 | auto")
    gen.add_argument("--device", default="auto", help="cpu | cuda | auto")
    gen.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's choice)")
    _speculative_args(gen)

    demo = sub.add_parser("demo", help="plain vs speculative (prompt lookup) decoding on a copy-heavy prompt")
    demo.add_argument("--model", default=None, help="default: the embedded SmolLM2-135M-Instruct")
    demo.add_argument("--max-tokens", type=int, default=96)
    demo.add_argument("--threads", type=int, default=1)
    demo.add_argument("--dtype", default="float32")

    conv = sub.add_parser("convert", help="convert a .gguf file into a Hugging Face-style folder, once")
    conv.add_argument("gguf")
    conv.add_argument("out_dir")
    conv.add_argument("--dtype", default="float32", help="float32 | bfloat16 | float16")

    args = parser.parse_args(argv)
    try:
        if args.command == "convert":
            return _convert(args)
        if args.command == "demo":
            return _demo(args)
        return _generate(args)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


def _convert(args) -> int:
    from specdec.model.gguf import convert_gguf

    start = time.perf_counter()
    convert_gguf(args.gguf, args.out_dir, dtype=args.dtype)
    print(f"wrote {args.out_dir} in {time.perf_counter() - start:.1f} s")
    return 0


def _generate(args) -> int:
    import torch

    import specdec

    if args.threads:
        torch.set_num_threads(args.threads)
    model = args.model
    if model is None:
        from specdec.model.default_model import default_model_path

        model = default_model_path()
    llm = specdec.LLM(model, dtype=args.dtype, device=args.device, speculative=_speculative_config(args))
    params = specdec.SamplingParams(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
                                    max_tokens=args.max_tokens, seed=args.seed)
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
    n = len(out.outputs[0].token_ids) if out is not None else 0
    print(f"[{n} tokens in {elapsed:.2f} s: {n / elapsed:.1f} tokens/s, {torch.get_num_threads()} threads, "
          f"finish_reason={out.outputs[0].finish_reason if out else None}]", file=sys.stderr)
    if out is not None and out.metrics.get("num_rounds"):
        m = out.metrics
        print(f"[speculative: acceptance {m['acceptance_rate']:.2f}, alpha {m['alpha']:.2f}, "
              f"{m['mean_tokens_per_round']:.2f} tokens/round over {m['num_rounds']} rounds]", file=sys.stderr)
    return 0


def _speculative_args(parser) -> None:
    group = parser.add_argument_group("speculative decoding")
    group.add_argument("--speculative-method", default=None,
                       help="draft_model | ngram | prompt_lookup | combined (default: plain decoding)")
    group.add_argument("--draft-model", default=None, help="draft model for draft_model / combined")
    group.add_argument("--num-speculative-tokens", type=int, default=4)
    group.add_argument("--adaptive", action="store_true", help="adapt k per request; 0 switches speculation off")


def _speculative_config(args):
    import specdec

    if args.speculative_method is None:
        if args.draft_model is not None:
            raise ValueError("--draft-model needs --speculative-method draft_model or combined")
        return None
    return specdec.SpeculativeConfig(method=args.speculative_method, draft_model=args.draft_model,
                                     num_speculative_tokens=args.num_speculative_tokens, adaptive=args.adaptive)


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
    model = args.model
    if model is None:
        from specdec.model.default_model import default_model_path

        model = default_model_path()
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
