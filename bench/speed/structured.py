"""Structured outputs: decoding speed under a JSON schema, plain and speculative, with and without forced text.

On the default model (SmolLM2-135M-Instruct), greedy, one thread, chat prompts each asking for a JSON object of a
schema (``bench/prompts/structured.json``: a person, a product, an order, an event). Engines, built once and run
interleaved, ``--reps`` times per prompt after a warm-up run:

- ``unconstrained``: plain decoding of the same prompts without a schema (what the constraint costs);
- ``plain``: plain decoding under the schema;
- ``prompt_lookup``: prompt lookup under the schema, the grammar's forced text drafted for free
  (``specdec/spec_decode/forced_drafts.py``);
- ``prompt_lookup_no_forced``: the same with the forced text off (chains only cut to the grammar);
- ``draft_model``: the target's own int4 copy as the draft (``draft_model="self"``), q masked by the grammar.

Per engine: tokens/s (generated tokens / wall time of ``generate``, prefill included), speedup over ``plain``,
drafted / accepted tokens, and whether every answer parsed and validated (finish_reason "stop"). Greedy
speculative answers must equal the plain ones (checked, reported).

    python -m bench.speed.structured --threads 1 --reps 3 [--dtype float32] [--record]
"""

from __future__ import annotations

import argparse
import json
import time

from bench.common import (
    PROMPTS_DIR,
    add_record_flag,
    git_commit,
    machine_info,
    median,
    print_table,
    resolve_model,
    set_threads,
    write_json,
)
from specdec import LLM, SamplingParams, SpeculativeConfig
from specdec.spec_decode import forced_drafts

ENGINES = ("unconstrained", "plain", "prompt_lookup", "prompt_lookup_no_forced", "draft_model")


def load_cases() -> list[dict]:
    with open(PROMPTS_DIR / "structured.json", encoding="utf-8") as f:
        return json.load(f)


def valid(schema: dict, value) -> bool:
    """The bench schemas' check: an object with exactly the required keys, each of the declared JSON type."""
    types = {"string": str, "integer": int, "number": (int, float), "boolean": bool, "array": list, "object": dict}
    props = schema["properties"]
    return (isinstance(value, dict) and set(value) == set(schema["required"])
            and all(isinstance(value[k], types[props[k]["type"]]) for k in value))


def build(model: str, dtype: str) -> dict[str, LLM]:
    lookup = SpeculativeConfig(method="prompt_lookup", num_speculative_tokens=4, prompt_lookup_min=2)
    self_draft = SpeculativeConfig(draft_model="self", draft_quantization="int4", num_speculative_tokens=4)
    common = dict(dtype=dtype, max_model_len=1024, max_num_seqs=1, kv_cache_memory_gb=0.25)
    plain = LLM(model, **common)
    return {"unconstrained": plain, "plain": plain, "prompt_lookup": LLM(model, speculative=lookup, **common),
            "draft_model": LLM(model, speculative=self_draft, **common)}


def run_one(llms: dict[str, LLM], name: str, case: dict, max_tokens: int) -> dict:
    llm = llms["prompt_lookup"] if name == "prompt_lookup_no_forced" else llms[name]
    constraint = None if name == "unconstrained" else {"json": case["schema"]}
    params = SamplingParams(temperature=0, max_tokens=max_tokens, structured_outputs=constraint)
    forced_drafts.FORCED_TEXT = name != "prompt_lookup_no_forced"
    try:
        start = time.perf_counter()
        out = llm.chat([[{"role": "user", "content": case["prompt"]}]], params)[0]
        seconds = time.perf_counter() - start
    finally:
        forced_drafts.FORCED_TEXT = True
    text = out.outputs[0].text
    try:
        ok = out.outputs[0].finish_reason == "stop" and valid(case["schema"], json.loads(text))
    except json.JSONDecodeError:
        ok = False
    return {"seconds": seconds, "tokens": len(out.outputs[0].token_ids), "text": text, "valid": ok,
            "drafted": out.metrics["drafted"], "accepted": out.metrics["accepted"]}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=160)
    add_record_flag(parser)
    args = parser.parse_args(argv)
    set_threads(args.threads)
    llms = build(resolve_model(args.model), args.dtype)
    cases = load_cases()
    runs: dict[str, list[dict]] = {name: [] for name in ENGINES}
    for case in cases:
        for name in ENGINES:  # warm-up: every engine once on this prompt
            run_one(llms, name, case, args.max_tokens)
        for _ in range(args.reps):
            for name in ENGINES:  # interleaved
                runs[name].append({"case": case["name"], **run_one(llms, name, case, args.max_tokens)})
    summary = {}
    for name in ENGINES:
        per_case = {}
        for case in cases:
            rs = [r for r in runs[name] if r["case"] == case["name"]]
            per_case[case["name"]] = rs[0]["tokens"] / median([r["seconds"] for r in rs])
        summary[name] = {
            "tokens_per_s": {c: round(v, 2) for c, v in per_case.items()},
            "mean_tokens_per_s": round(sum(per_case.values()) / len(per_case), 2),
            "drafted": sum(r["drafted"] for r in runs[name]), "accepted": sum(r["accepted"] for r in runs[name]),
            "all_valid": all(r["valid"] for r in runs[name]) if name != "unconstrained" else None,
            "same_text_as_plain": (all(r["text"] == p["text"] for r, p in zip(runs[name], runs["plain"]))
                                   if name not in ("unconstrained", "plain") else None),
        }
    for name in ENGINES:
        row = summary[name]
        row["speedup_over_plain"] = {c: round(row["tokens_per_s"][c] / summary["plain"]["tokens_per_s"][c], 3)
                                     for c in row["tokens_per_s"]}
    rows = [[name, *(summary[name]["tokens_per_s"][c["name"]] for c in cases),
             *(summary[name]["speedup_over_plain"][c["name"]] for c in cases), summary[name]["drafted"],
             summary[name]["accepted"], summary[name]["all_valid"], summary[name]["same_text_as_plain"]]
            for name in ENGINES]
    print_table(rows, ["engine", *(f"{c['name']} tok/s" for c in cases), *(f"{c['name']} x" for c in cases),
                       "drafted", "accepted", "valid", "= plain"])
    payload = {"benchmark": "structured", "model": args.model, "dtype": args.dtype, "threads": args.threads,
               "reps": args.reps, "max_tokens": args.max_tokens, "commit": git_commit(), "machine": machine_info(),
               "summary": summary, "runs": runs}
    path = write_json(f"structured_{args.model}_{args.dtype}_t{args.threads}", payload, args.record)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
