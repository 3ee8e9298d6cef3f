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

    conv = sub.add_parser("convert", help="convert a .gguf file into a Hugging Face-style folder, once")
    conv.add_argument("gguf")
    conv.add_argument("out_dir")
    conv.add_argument("--dtype", default="float32", help="float32 | bfloat16 | float16")

    args = parser.parse_args(argv)
    try:
        if args.command == "convert":
            return _convert(args)
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
    llm = specdec.LLM(model, dtype=args.dtype, device=args.device)
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
    return 0


if __name__ == "__main__":
    sys.exit(main())
