"""Acceptance traces: where on a real target text a draft model's greedy chain would be accepted.

For each prompt the target generates its greedy text; the draft model then reads prompt + text in one prefill
(teacher forcing) and ``match[p]`` says whether its greedy token at text position p equals the target's. While
drafts are accepted the draft's context *is* the target's text, so a chain round starting at p accepts exactly the
run of matches from p (capped at k): one prefill prices every policy that chooses k per round, offline. The traces
replay adaptive k against fixed k (``tests/unit/spec_decode/test_adaptive_traces.py``); they are a design and
regression aid, and end-to-end speed is still measured by ``bench.speed.adaptive_k``.

What a trace does not hold: the draft's decode path in place of one prefill (bf16 rounding can differ), and in
bf16 each speculative configuration's own text (windows of different length round differently, so the texts of
two configurations can part after a few tokens; in float32 they are the same).

    python -m bench.acceptance.acceptance_trace --target qwen-1.5b --draft qwen-0.5b --max-tokens 256 \\
        --dtype bfloat16 --quantization int8 --draft-quantization int4 --out tests/data/acceptance_traces_qwen.json
"""

from __future__ import annotations

import argparse
import json

import torch

import specdec
from bench.common import PROMPT_CLASSES, chat_token_ids, load_prompts, resolve_model, set_threads
from specdec.training.features import target_features


def accepted_run(match: str | list[int], pos: int, k: int) -> int:
    """Drafts a chain round of ``k`` starting at text position ``pos`` accepts: the run of matches from there."""
    accepted = 0
    while accepted < k and pos + accepted < len(match) and int(match[pos + accepted]):
        accepted += 1
    return accepted


def draft_matches(draft_engine, prompt_ids: list[int], text: list[int]) -> list[int]:
    """``match[p]`` (0/1, len(text)): the draft's greedy token after prompt + text[:p] is text[p] (one prefill)."""
    argmax = target_features(draft_engine, [prompt_ids + text], (1,), torch.float32)[0]["argmax"].tolist()
    return [int(argmax[len(prompt_ids) + p - 1] == text[p]) for p in range(len(text))]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", default="qwen-1.5b")
    ap.add_argument("--draft", default="qwen-0.5b")
    ap.add_argument("--prompts", default=",".join(PROMPT_CLASSES), help="prompt classes, comma-separated")
    ap.add_argument("--prompts-per-class", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--quantization", default=None)
    ap.add_argument("--draft-quantization", default=None)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    set_threads(args.threads)
    common = dict(dtype=args.dtype, max_model_len=2048, num_kv_blocks=256)
    target = specdec.LLM(resolve_model(args.target), quantization=args.quantization, **common)
    draft = specdec.LLM(resolve_model(args.draft), quantization=args.draft_quantization, **common)
    params = specdec.SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
    traces = {}
    for cls, prompts in load_prompts(args.prompts.split(","), args.prompts_per_class).items():
        for prompt in prompts:
            ids = chat_token_ids(target.engine.tokenizer, prompt.text)
            text = list(target.generate(prompt_token_ids=[ids], sampling_params=params)[0].outputs[0].token_ids)
            match = draft_matches(draft.engine, ids, text)
            traces[f"{cls}/{prompt.name}"] = "".join(map(str, match))
            print(f"{cls}/{prompt.name}: draft matches the target at {sum(match) / len(match):.3f} of positions",
                  flush=True)
    out = {"target": args.target, "draft": args.draft, "dtype": args.dtype, "quantization": args.quantization,
           "draft_quantization": args.draft_quantization, "max_tokens": args.max_tokens, "match": traces}
    with open(args.out, "w") as f:
        json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
