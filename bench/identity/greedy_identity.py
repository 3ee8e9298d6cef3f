"""Greedy identity on real weights (issue 33): does every speculative method give plain greedy decoding's tokens,
and does a request give the same tokens in a batch as alone?

For each precision (bf16, int8, int4 - the model's linears quantised while loading; ``--quantize-lm-head`` for the
head too) and batch size, one plain run per batch size and one run per speculative method; every request of a
speculative run and of a batched plain run is compared token for token with the same request decoded plainly
alone (batch 1). Prompts: the bench prompts (code, json, copy, prose, long) and 12 chat prompts of six kinds
(``chat_prompts.json``, through the model's chat template), ``--max-tokens`` (default 128), stopping at EOS.

    python -m bench.identity.greedy_identity --model smollm2 --precisions bf16 int8 int4 --batch 1 8 \
        --invariant on off --out bench/results/<dir>/identity.json

Nothing here changes the library; ``--invariant off`` is ``LLM(batch_invariant=False)`` (oneDNN and SDPA).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from bench.common import PROMPTS_DIR, resolve_model
from specdec import LLM, SamplingParams, SpeculativeConfig

METHODS = {
    "prompt_lookup": dict(method="prompt_lookup", num_speculative_tokens=4),
    "ngram_table": dict(method="ngram_table", num_speculative_tokens=4),
    "draft_model_int4_self": dict(method="draft_model", draft_model="self", draft_quantization="int4",
                                  num_speculative_tokens=4),
    "prompt_lookup_tree": dict(method="prompt_lookup", num_speculative_tokens=4, tree=[2, 2, 1, 1]),
    "draft_model": dict(method="draft_model", num_speculative_tokens=4),  # the draft given by --draft
    # issue 34's drafters: state shared across the run's requests (the recycle matrix, the suffix index)
    "recycle": dict(method="recycle", num_speculative_tokens=4, tree_policy="always"),
    "suffix": dict(method="suffix", num_speculative_tokens=8),
    "pick": dict(method="pick", num_speculative_tokens=6),
}


def prompts(tokenizer, include_long: bool) -> list[tuple[str, str]]:
    out = []
    for kind in ("code", "json", "copy", "prose") + (("long",) if include_long else ()):
        for path in sorted((PROMPTS_DIR / kind).glob("*.txt"))[:2]:
            out.append((f"{kind}/{path.stem}", path.read_text()))
    chat = json.loads((Path(__file__).parent / "chat_prompts.json").read_text())
    for i, item in enumerate(chat):
        text = tokenizer.apply_chat_template([{"role": "user", "content": item["text"]}], add_generation_prompt=True)
        out.append((f"chat/{item['kind']}/{i}", text))
    return out


def run(llm: LLM, texts: list[str], max_tokens: int, batch: int) -> list[list[int]]:
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0)
    out = []
    for start in range(0, len(texts), batch):
        for r in llm.generate(texts[start : start + batch], params):
            out.append(list(r.outputs[0].token_ids))
    return out


def first_difference(a: list[int], b: list[int]) -> int | None:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--precisions", nargs="+", default=["bf16", "int8", "int4"])
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--methods", nargs="+", default=None,
                    help="default: every method but draft_model, which needs --draft (and is added with it)")
    ap.add_argument("--invariant", nargs="+", default=["on", "off"])
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--quantize-lm-head", action="store_true")
    ap.add_argument("--long", action="store_true", help="include the long-document prompts")
    ap.add_argument("--draft", default=None, help="the draft of method draft_model (folder or smollm2 | qwen-0.5b)")
    ap.add_argument("--out")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    if args.methods is None:
        args.methods = [m for m in METHODS if m != "draft_model" or args.draft]
    if "draft_model" in args.methods and not args.draft:
        raise SystemExit("method draft_model needs --draft")
    path = resolve_model(args.model)
    results = []
    for invariant in args.invariant:
        for precision in args.precisions:
            quant = None if precision == "bf16" else precision
            common = dict(dtype="bfloat16", quantization=quant, batch_invariant=invariant == "on",
                          quantize_lm_head=True if args.quantize_lm_head and quant else None)
            base = LLM(path, **common)
            named = prompts(base.tokenizer, args.long)
            texts = [t for _, t in named]
            t0 = time.time()
            alone = run(base, texts, args.max_tokens, 1)
            runs = {"plain": base}
            for name in args.methods:
                spec = dict(METHODS[name])
                if name == "draft_model":
                    spec["draft_model"] = resolve_model(args.draft)
                runs[name] = LLM(path, speculative=SpeculativeConfig(**spec), **common)
            for name, llm in runs.items():
                for batch in args.batch:
                    if name == "plain" and batch == 1:
                        continue
                    got = run(llm, texts, args.max_tokens, batch)
                    diffs = {named[i][0]: first_difference(alone[i], got[i]) for i in range(len(texts))}
                    differing = {k: v for k, v in diffs.items() if v is not None}
                    row = dict(invariant=invariant, precision=precision, method=name, batch=batch,
                               identical=len(texts) - len(differing), prompts=len(texts), differing=differing)
                    results.append(row)
                    print(f"invariant={invariant:3s} {precision:5s} {name:22s} b{batch}: "
                          f"{row['identical']}/{row['prompts']} identical"
                          + (f"  first differences {differing}" if differing else ""), flush=True)
            print(f"  ({time.time() - t0:.0f} s)", flush=True)
            del runs, base
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(dict(model=args.model, threads=args.threads,
                                                  max_tokens=args.max_tokens, results=results), indent=1))


if __name__ == "__main__":
    main()
