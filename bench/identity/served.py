"""Served greedy identity (issue 33): do 8 chat requests sharing one long system prompt get the same answer from
``specdec serve`` when sent together as when sent one at a time?

For each server configuration it starts ``specdec serve`` (the default model in its default dtype - bf16 on CPUs
with native bf16 - unless ``--dtype``) on a free loopback port, sends the 8 requests one after another (each
alone), then all 8 at once, and compares the answers' token ids (``logprobs`` off; the text and the finish reason).

    python -m bench.identity.served --configs plain plain-invariant-off prompt_lookup \
        --out bench/results/<dir>/served.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import tempfile
from pathlib import Path

from bench.common import resolve_model
from bench.serving.load import SHARED_QUESTIONS, SHARED_SYSTEM, _free_port, start_server

CONFIGS = {
    "plain": [],
    "plain-invariant-off": ["--batch-invariant", "off"],
    "prompt_lookup": ["--speculative-method", "prompt_lookup", "--num-speculative-tokens", "4"],
    "prompt_lookup-invariant-off": ["--speculative-method", "prompt_lookup", "--num-speculative-tokens", "4",
                                    "--batch-invariant", "off"],
    "ngram_table": ["--speculative-method", "ngram_table", "--num-speculative-tokens", "4"],
}


async def ask(client, question: str, max_tokens: int) -> str:
    r = await client.chat.completions.create(
        model="bench", messages=[{"role": "system", "content": SHARED_SYSTEM}, {"role": "user", "content": question}],
        max_tokens=max_tokens, temperature=0.0)
    return r.choices[0].message.content


async def compare(url: str, max_tokens: int) -> dict:
    from openai import AsyncOpenAI

    client = AsyncOpenAI(base_url=f"{url}/v1", api_key="none")
    alone = [await ask(client, q, max_tokens) for q in SHARED_QUESTIONS]
    together = await asyncio.gather(*(ask(client, q, max_tokens) for q in SHARED_QUESTIONS))
    same = [a == b for a, b in zip(alone, together)]
    return {"identical": sum(same), "requests": len(same), "differing": [i for i, s in enumerate(same) if not s]}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--configs", nargs="+", default=list(CONFIGS))
    ap.add_argument("--dtype", default=None)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--out")
    args = ap.parse_args()
    model = resolve_model("smollm2")
    dtype_flags = ["--dtype", args.dtype or "auto"]  # after start_server's own --dtype: argparse keeps the last
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.configs:
            port = _free_port()
            proc = start_server(model, CONFIGS[name] + dtype_flags, port, args.threads, 2048, Path(tmp) / f"{name}.log")
            try:
                results[name] = asyncio.run(compare(f"http://127.0.0.1:{port}", args.max_tokens))
            finally:
                proc.terminate()
                proc.wait(timeout=60)
            print(name, json.dumps(results[name]), flush=True)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(dict(threads=args.threads, max_tokens=args.max_tokens,
                                                  dtype=args.dtype or "auto", results=results), indent=1))


if __name__ == "__main__":
    main()
