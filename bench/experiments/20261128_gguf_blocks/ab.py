"""Old vs new specdec (or two quantisations) on the same CPU workloads, in lockstep (issue 35: a GGUF's Q4_K blocks
run as stored must be at least as fast as today's int4, its Q6_K ones at least as fast as today's bf16 path; and the
w4a8 kernel's new fp32-scale mode must not slow its fp16 path).

Two worker processes - each a site folder with ``specdec/`` and ``specdec/kernels/`` (a ``git archive`` of a
commit) and a quantisation - hold MODEL in DTYPE, and the parent asks them in turn (alternating which goes first) to
run one timed generation. Per workload and side: the median decode seconds (first token to last) and tok/s, the
paired median old/new time (> 1: new faster), and whether the token ids agree.

    python ab.py OLD_SITE OLD_QUANT NEW_SITE NEW_QUANT MODEL DTYPE REPS OUT.json    (QUANT: none | int8 | int4 | gguf)

MODEL: a .gguf path, or "default" (the embedded SmolLM2). Workloads: plain greedy at batch 1 and 8 (48 tokens,
prose) and prompt lookup k=4 at batch 1 (copy prompt, 96 tokens: k+1-row windows). 1 thread per worker.
"""

import json
import os
import statistics
import subprocess
import sys
import time

WORKER = r'''
import json, sys, time, torch
torch.set_num_threads(1)
import specdec
from bench.common import chat_token_ids, load_prompts
model, dtype, quant = sys.argv[1], sys.argv[2], None if sys.argv[3] == "none" else sys.argv[3]
kw = {} if model == "default" else {"model": model}
plain = specdec.LLM(dtype=dtype, quantization=quant, **kw)
lookup = specdec.LLM(dtype=dtype, quantization=quant, speculative=specdec.SpeculativeConfig(
    method="prompt_lookup", num_speculative_tokens=4), **kw)
tok = plain.tokenizer
texts = load_prompts(["prose", "copy"])
prose = [chat_token_ids(tok, p.text) for p in texts["prose"]]
copy = [chat_token_ids(tok, p.text) for p in texts["copy"]]
def run(llm, prompts, n):
    params = specdec.SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
    t0 = time.perf_counter()
    outs = llm.generate(prompt_token_ids=prompts, sampling_params=params)
    wall = time.perf_counter() - t0
    first = max(o.metrics["time_to_first_token"] for o in outs)
    last = max(o.metrics["wall_time"] for o in outs)
    return {"decode_s": last - first, "wall_s": wall, "tokens": [o.outputs[0].token_ids for o in outs]}
work = {"plain_b1": (plain, prose[:1], 48), "plain_b8": (plain, (prose * 8)[:8], 48),
        "lookup_b1": (lookup, copy[:1], 96)}
for llm, p, n in work.values():
    run(llm, p[:1], 4)
print("ready", flush=True)
for line in sys.stdin:
    name = line.strip()
    llm, p, n = work[name]
    r = run(llm, p, n)
    r["batch"], r["max_tokens"] = len(p), n
    print(json.dumps(r), flush=True)
'''


def main():
    old_site, old_quant, new_site, new_quant, model, dtype, reps, out = sys.argv[1:9]
    reps = int(reps)
    bench_root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    workers = {}
    for name, site, quant in (("old", old_site, old_quant), ("new", new_site, new_quant)):
        env = dict(os.environ, PYTHONPATH=f"{site}:{bench_root}", OMP_NUM_THREADS="1")
        workers[name] = subprocess.Popen([sys.executable, "-c", WORKER, model, dtype, quant], stdin=subprocess.PIPE,
                                         stdout=subprocess.PIPE, text=True, env=env, cwd="/tmp")
    for w in workers.values():
        assert w.stdout.readline().strip() == "ready"
    results = {}
    for work in ("plain_b1", "plain_b8", "lookup_b1"):
        samples = {"old": [], "new": []}
        for rep in range(reps):
            for name in (("old", "new") if rep % 2 == 0 else ("new", "old")):
                workers[name].stdin.write(work + "\n")
                workers[name].stdin.flush()
                samples[name].append(json.loads(workers[name].stdout.readline()))
        row = {}
        for name, runs in samples.items():
            b, n = runs[0]["batch"], runs[0]["max_tokens"]
            decode = statistics.median(r["decode_s"] for r in runs)
            row[name] = {"tok_s": b * (n - 1) / decode, "seconds": [r["decode_s"] for r in runs]}
        row["paired_median_old_over_new"] = statistics.median(o["decode_s"] / n["decode_s"]
                                                              for o, n in zip(samples["old"], samples["new"]))
        row["tokens_identical"] = samples["old"][0]["tokens"] == samples["new"][0]["tokens"]
        results[work] = row
        print(work, json.dumps({k: (v if not isinstance(v, dict) else round(v["tok_s"], 2))
                                for k, v in row.items()}), flush=True)
    for w in workers.values():
        w.stdin.close()
        w.wait()
    results["meta"] = {"model": model, "dtype": dtype, "old": [old_site, old_quant], "new": [new_site, new_quant],
                       "reps": reps, "threads": 1, "time": time.strftime("%Y-%m-%d %H:%M")}
    with open(out, "w") as f:
        json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
