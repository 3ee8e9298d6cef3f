"""Old vs new specdec on the same CPU workloads, in lockstep: two worker processes (one per code version, each a
site folder with ``specdec/`` and ``specdec/kernels/``) hold the embedded SmolLM2 model, and the parent asks them in
turn (alternating which goes first) to run one timed generation. Per workload and version: the median decode
seconds (first token to last, as bench.speed.plain_decode measures) and tok/s; the token ids of both versions compared.

    python ab.py OLD_SITE NEW_SITE DTYPE REPS OUT.json

Workloads: plain greedy at batch 1 and 8 (64 tokens, prose prompts), prompt lookup k=4 at batch 1 (copy prompt,
128 tokens). 1 thread per worker.
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
dtype = sys.argv[1]
plain = specdec.LLM(dtype=dtype)
lookup = specdec.LLM(dtype=dtype, speculative=specdec.SpeculativeConfig(method="prompt_lookup",
                                                                         num_speculative_tokens=4))
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
work = {"plain_b1": (plain, prose[:1], 64), "plain_b8": (plain, (prose * 8)[:8], 64),
        "lookup_b1": (lookup, copy[:1], 128)}
for llm, p, n in work.values():
    run(llm, p, 4)
print("ready", flush=True)
for line in sys.stdin:
    name = line.strip()
    llm, p, n = work[name]
    r = run(llm, p, n)
    r["batch"], r["max_tokens"] = len(p), n
    print(json.dumps(r), flush=True)
'''


def main():
    old_site, new_site, dtype, reps, out = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]), sys.argv[5]
    bench_root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    workers = {}
    for name, site in (("old", old_site), ("new", new_site)):
        env = dict(os.environ, PYTHONPATH=f"{site}:{bench_root}", OMP_NUM_THREADS="1")
        workers[name] = subprocess.Popen([sys.executable, "-c", WORKER, dtype], stdin=subprocess.PIPE,
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
            row[name] = {"decode_tok_s": b * (n - 1) / decode, "decode_s": [r["decode_s"] for r in runs]}
        row["new_over_old"] = row["new"]["decode_tok_s"] / row["old"]["decode_tok_s"]
        row["paired_median"] = statistics.median(o["decode_s"] / n["decode_s"]
                                                 for o, n in zip(samples["old"], samples["new"]))
        row["tokens_identical"] = samples["old"][0]["tokens"] == samples["new"][0]["tokens"]
        results[work] = row
        print(work, json.dumps({k: (v if not isinstance(v, dict) else round(v["decode_tok_s"], 2))
                                for k, v in row.items()}), flush=True)
    for w in workers.values():
        w.stdin.close()
        w.wait()
    results["meta"] = {"dtype": dtype, "reps": reps, "threads": 1, "time": time.strftime("%Y-%m-%d %H:%M")}
    with open(out, "w") as f:
        json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
