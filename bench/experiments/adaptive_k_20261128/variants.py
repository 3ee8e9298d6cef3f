"""Adaptive-k variants against plain and fixed k on the Qwen pair, one process, lockstep (experiment, 2026-11-28).

    PYTHONPATH=. python bench/experiments/adaptive_k_20261128/variants.py VARIANTS_JSON FIXED REPS CLASSES DTYPE TOKENS OUT

VARIANTS_JSON: {name: AdaptiveK keyword arguments} (names start with "adaptive"); FIXED: e.g. plain,k=2,k=3,k=4.
Per class: CPU-time tok/s, paired ratios over the best fixed configuration, and priced ratios (every decode step at
the run's median step time for its k: bench.speed.adaptive_k.priced_seconds)."""
import json
import statistics
import sys
from collections import Counter
from types import SimpleNamespace

from bench.common import set_threads
from bench.speed import adaptive_k as AK
from specdec.spec_decode.adaptive import AdaptiveK

set_threads(1)
variants = json.loads(sys.argv[1])
fixed = sys.argv[2].split(",")
reps, classes, dtype, tokens, out_path = int(sys.argv[3]), sys.argv[4], sys.argv[5], int(sys.argv[6]), sys.argv[7]
args = SimpleNamespace(target="qwen-1.5b", draft="qwen-0.5b", method="draft_model", k=4, prompts=classes,
                       prompts_per_class=1, max_tokens=tokens, reps=reps, dtype=dtype, max_model_len=2048,
                       num_kv_blocks=256, prompt_lookup_min=2, quantization=None, draft_quantization=None)
orig_new = AK.new_engine


def new_engine(args, name):
    llm = orig_new(args, "adaptive" if name.startswith("adaptive") else name)
    if name in variants:
        dec, kw = llm.engine.speculative, dict(variants[name])
        dec._new_adaptive = lambda: AdaptiveK(dec.k_max, dec.cost_model, adapt_depth=True, **kw)
        dec.reset_adaptive()
    return llm


AK.new_engine = new_engine
names = fixed + list(variants)
runs = AK.measure_shared(args, names)
for cls, by in runs.items():
    toks = sum(len(t) for t in by[names[0]][0]["tokens"])
    cpu = {n: statistics.median(r["cpu_seconds"] for r in rs) for n, rs in by.items()}
    best = min(fixed, key=cpu.get)
    table = AK.step_table(by)
    priced = {n: [AK.priced_seconds(r, table) for r in rs] for n, rs in by.items()}
    pbest = min(fixed, key=lambda n: statistics.median(priced[n]))
    same = all(r["tokens"] == by[names[0]][0]["tokens"] for rs in by.values() for r in rs)
    rates = " ".join(f"{n}={toks / cpu[n]:.2f}" for n in names)
    print(f"{cls}: {toks} tokens, texts identical: {same}; tok/s by CPU {rates}")
    for n in variants:
        paired = statistics.median(b["cpu_seconds"] / a["cpu_seconds"] for a, b in zip(by[n], by[best]))
        pr = statistics.median(b / a for a, b in zip(priced[n], priced[pbest]))
        own = AK.step_table({n: by[n]})
        print(f"  {n}: over {best} {cpu[best] / cpu[n]:.3f}, paired {paired:.3f}; priced over {pbest} {pr:.3f}; "
              f"k {dict(sorted(Counter(k for r in by[n] for k in r['k_per_step']).items()))}; "
              f"step/fixed " + " ".join(f"{k}:{own[k] / table[k]:.3f}" for k in sorted(own)), flush=True)
    print("  step medians " + " ".join(f"{k}:{v * 1000:.0f}ms" for k, v in sorted(table.items())), flush=True)
json.dump(runs, open(out_path, "w"), default=lambda o: list(o) if isinstance(o, tuple) else str(o))
