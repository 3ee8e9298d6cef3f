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

from bench.serving.load import SHARED_QUESTIONS, SHARED_SYSTEM, _free_port

CONFIGS = {
    "plain": [],
    "plain-invariant-off": ["--batch-invariant", "off"],
    "prompt_lookup": ["--speculative-method", "prompt_lookup", "--num-speculative-tokens", "4"],
    "prompt_lookup-invariant-off": ["--speculative-method", "prompt_lookup", "--num-speculative-tokens", "4",
                                    "--batch-invariant", "off"],
    "ngram_table": ["--speculative-method", "ngram_table", "--num-speculative-tokens", "4"],
}


def start(model_flags: list[str], config: list[str], port: int, threads: int, log: Path):
    import os
    import subprocess
    import sys
    import time
    import urllib.request

    cmd = [sys.executable, "-m", "specdec", "serve", *model_flags, "--served-model-name", "bench", "--port",
           str(port), "--threads", str(threads), *config]
    proc = subprocess.Popen(cmd, stdout=log.open("w"), stderr=subprocess.STDOUT,
                            env={**os.environ, "OMP_NUM_THREADS": str(threads)})
    deadline = time.monotonic() + 300
    while True:
        if proc.poll() is not None:
            raise SystemExit(f"the server exited ({proc.returncode}); see {log}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2):
                return proc
        except OSError:
            if time.monotonic() > deadline:
                proc.kill()
                raise SystemExit("the server did not come up in 300 s") from None
            time.sleep(0.2)


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
    model_flags = ["--dtype", args.dtype] if args.dtype else []
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.configs:
            port = _free_port()
            proc = start(model_flags, CONFIGS[name], port, args.threads, Path(tmp) / f"{name}.log")
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
