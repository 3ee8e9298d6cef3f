"""Tensor parallelism launched by torchrun: every rank runs this script (docs/tensor_parallel.md).

    torchrun --nproc-per-node 2 docs/examples/tp_torchrun.py MODEL [--draft DRAFT] [--prompt TEXT ...]

On rank 0 ``LLM(...)`` builds the engine and the script goes on to generate; on every other rank the same call
loads that rank's shards and serves rank 0 until it shuts the engine down, then ends the process - so nothing
after it runs there. ``tensor_parallel_size`` must be torchrun's ``WORLD_SIZE``. Rank 0 prints one JSON line per
prompt (its text and token ids).
"""

import argparse
import json
import os

from specdec import LLM, SamplingParams, SpeculativeConfig


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("model", help="a model folder, .gguf file or hub id")
    parser.add_argument("--draft", help="a draft model: speculative decoding, the draft sharded over the same ranks")
    parser.add_argument("--k", type=int, default=4, help="draft tokens per round (with --draft)")
    parser.add_argument("--prompt", action="append", help="a prompt (repeatable)")
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--kv-cache-memory-gb", type=float, default=0.25, help="KV pool per rank")
    args = parser.parse_args()
    spec = SpeculativeConfig(draft_model=args.draft, num_speculative_tokens=args.k) if args.draft else None
    # ranks >= 1 serve inside this call and exit when rank 0 shuts the engine down
    with LLM(args.model, dtype=args.dtype, kv_cache_memory_gb=args.kv_cache_memory_gb, speculative=spec,
             tensor_parallel_size=int(os.environ.get("WORLD_SIZE", "1"))) as llm:
        params = SamplingParams(temperature=0, max_tokens=args.max_tokens)
        for out in llm.generate(args.prompt or ["The capital of France is"], params):
            print(json.dumps({"prompt": out.prompt, "text": out.outputs[0].text,
                              "token_ids": out.outputs[0].token_ids}), flush=True)


if __name__ == "__main__":
    main()
