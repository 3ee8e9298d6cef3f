"""Old vs new specdec on the same CPU workloads, in lockstep (issue 33: the batch-invariant kernels must be at least
as fast as the fast path they replace at decode and at verification windows).

Two worker processes - one per code version, each a site folder with ``specdec/`` and ``specdec/kernels/`` (a
``git archive`` of the commit) - hold the embedded SmolLM2 model in ``DTYPE`` (optionally quantised), and the parent
asks them in turn (alternating which goes first) to run one timed generation. Per workload and version: the median
decode seconds (first token to last) and tok/s, the paired median old/new time (> 1: new faster), and whether the
token ids agree.

    python ab.py OLD_SITE NEW_SITE DTYPE QUANT REPS OUT.json      (QUANT: none | int8 | int4)

Workloads: plain greedy at batch 1 and 8 (64 tokens, prose), prompt lookup k=4 at batch 1 and 8 (copy prompt, 128
tokens: k+1-row windows, 40-row batches of windows) and a prefill (the long-document prompt, 1 token: time to the
first token). 1 thread per worker.
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
dtype, quant = sys.argv[1], None if sys.argv[2] == "none" else sys.argv[2]
plain = specdec.LLM(dtype=dtype, quantization=quant)
lookup = specdec.LLM(dtype=dtype, quantization=quant, speculative=specdec.SpeculativeConfig(
    method="prompt_lookup", num_speculative_tokens=4))
cold = specdec.LLM(dtype=dtype, quantization=quant, enable_prefix_caching=False)  # every prefill computed
tok = plain.tokenizer
texts = load_prompts(["prose", "copy", "long"])
prose = [chat_token_ids(tok, p.text) for p in texts["prose"]]
copy = [chat_token_ids(tok, p.text) for p in texts["copy"]]
long = [chat_token_ids(tok, p.text) for p in texts["long"]]
def run(llm, prompts, n):
    params = specdec.SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
    t0 = time.perf_counter()
    outs = llm.generate(prompt_token_ids=prompts, sampling_params=params)
    wall = time.perf_counter() - t0
    first = max(o.metrics["time_to_first_token"] for o in outs)
    last = max(o.metrics["wall_time"] for o in outs)
    return {"decode_s": last - first if n > 1 else wall, "wall_s": wall,
            "tokens": [o.outputs[0].token_ids for o in outs], "prompt_tokens": sum(map(len, prompts))}
work = {"plain_b1": (plain, prose[:1], 64), "plain_b8": (plain, (prose * 8)[:8], 64),
        "lookup_b1": (lookup, copy[:1], 128), "lookup_b8": (lookup, (copy * 8)[:8], 128),
        "prefill_long": (cold, long[:1], 1)}
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
    old_site, new_site, dtype, quant, reps, out = sys.argv[1:7]
    reps = int(reps)
    bench_root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    workers = {}
    for name, site in (("old", old_site), ("new", new_site)):
        env = dict(os.environ, PYTHONPATH=f"{site}:{bench_root}", OMP_NUM_THREADS="1")
        workers[name] = subprocess.Popen([sys.executable, "-c", WORKER, dtype, quant], stdin=subprocess.PIPE,
                                         stdout=subprocess.PIPE, text=True, env=env, cwd="/tmp")
    for w in workers.values():
        assert w.stdout.readline().strip() == "ready"
    results = {}
    for work in ("plain_b1", "plain_b8", "lookup_b1", "lookup_b8", "prefill_long"):
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
            tokens = runs[0]["prompt_tokens"] if n == 1 else b * (n - 1)  # prefill: prompt tokens per second
            row[name] = {"tok_s": tokens / decode, "seconds": [r["decode_s"] for r in runs]}
        row["paired_median_old_over_new"] = statistics.median(o["decode_s"] / n["decode_s"]
                                                              for o, n in zip(samples["old"], samples["new"]))
        row["tokens_identical"] = samples["old"][0]["tokens"] == samples["new"][0]["tokens"]
        results[work] = row
        print(work, json.dumps({k: (v if not isinstance(v, dict) else round(v["tok_s"], 2))
                                for k, v in row.items()}), flush=True)
    for w in workers.values():
        w.stdin.close()
        w.wait()
    results["meta"] = {"dtype": dtype, "quantization": quant, "reps": reps, "threads": 1,
                       "time": time.strftime("%Y-%m-%d %H:%M")}
    with open(out, "w") as f:
        json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
