"""Adaptive variants vs fixed k, shared process, interleaved (experiment)."""
import json
import sys
from types import SimpleNamespace

from bench.common import set_threads
from bench.speed import adaptive_k as AK
from specdec.spec_decode.adaptive import AdaptiveK, Arm


class Cycle23(AdaptiveK):
    n = 0
    def choose_arm(self, seq_id, batch_size, k_cap, trees=True):
        super().choose_arm(seq_id, batch_size, k_cap, trees)
        Cycle23.n += 1
        return Arm(min(2 + Cycle23.n % 2, k_cap))
class Force2(AdaptiveK):
    def choose_arm(self, seq_id, batch_size, k_cap, trees=True):
        super().choose_arm(seq_id, batch_size, k_cap, trees)
        return Arm(min(2, k_cap))
class Force4(AdaptiveK):
    def choose_arm(self, seq_id, batch_size, k_cap, trees=True):
        super().choose_arm(seq_id, batch_size, k_cap, trees)
        return Arm(min(4, k_cap))

set_threads(1)
variants = json.loads(sys.argv[1])  # name -> AdaptiveK kwargs
fixed = sys.argv[2].split(",")
reps = int(sys.argv[3]); classes = sys.argv[4] if len(sys.argv) > 4 else "code,json,copy,prose"
dtype = sys.argv[5] if len(sys.argv) > 5 else "bfloat16"
quant = dict(quantization="int8", draft_quantization="int4") if dtype == "bfloat16" else dict(quantization=None, draft_quantization=None)
import os

args = SimpleNamespace(target=os.environ.get("TARGET", "qwen-1.5b"), draft=os.environ.get("DRAFT", "qwen-0.5b"), method=os.environ.get("METHOD", "draft_model"), k=4, prompts=classes,
                       prompts_per_class=1, max_tokens=int(sys.argv[6]) if len(sys.argv) > 6 else 64, reps=reps, dtype=dtype, max_model_len=2048,
                       num_kv_blocks=256, prompt_lookup_min=2, **quant)
orig_new = AK.new_engine
def new_engine(args, name):
    base = "adaptive" if name.startswith("adaptive") else name
    llm = orig_new(args, base)
    if name in variants:
        dec = llm.engine.speculative
        kw = variants[name]
        cls = kw.pop("cls", None)
        no_overhead = kw.pop("no_overhead", False)
        import importlib.util
        spec_ = importlib.util.spec_from_file_location("adaptive_old", "bench/experiments/adaptive_k_20261127/adaptive_old.py"); mod = importlib.util.module_from_spec(spec_); sys.modules["adaptive_old"] = mod; spec_.loader.exec_module(mod)
        K = {"force4": Force4, "cycle23": Cycle23, "force2": Force2, "old": mod.AdaptiveK}.get(cls, AdaptiveK)
        def make(dec=dec, kw=kw, K=K, no_overhead=no_overhead):
            if no_overhead:
                dec.cost_model.round_overhead = lambda *a, **k: 0.0
            return K(dec.k_max, dec.cost_model, adapt_depth=True, **kw)
        dec._new_adaptive = make
        dec.reset_adaptive()
    return llm
AK.new_engine = new_engine
orig_reset = AK.reset_cold
AK.reset_cold = lambda llm: llm.engine.speculative.reset_adaptive()
# measure_shared resets only engines named exactly "adaptive": patch the loop's check by naming
names = fixed + list(variants)
src_names = names
runs = AK.measure_shared(args, names)
summ = AK.summarize({cls: {n: r for n, r in by.items()} for cls, by in runs.items()})
for cls, by in runs.items():
    rates = {n: sum(len(t) for t in r[0]["tokens"]) / sorted(x["cpu_seconds"] for x in r)[len(r) // 2] for n, r in by.items()}
    best = max((n for n in rates if not n.startswith("adaptive")), key=rates.get)
    import statistics
    from collections import Counter
    paired = {n: statistics.median(sum(len(t) for t in by[n][i]["tokens"]) / by[n][i]["cpu_seconds"] / (sum(len(t) for t in by[best][i]["tokens"]) / by[best][i]["cpu_seconds"]) for i in range(len(by[n]))) for n in names}
    print(cls, "paired", " ".join(f"{n}={paired[n]:.3f}" for n in names))
    print(cls, "best", best, f"{rates[best]:.2f}", " ".join(f"{n}={rates[n]:.2f}({rates[n]/rates[best]:.3f})" for n in names))
    for n in variants:
        print("   ", n, dict(sorted(Counter(k for r in by[n] for k in r["k_per_step"]).items())))
json.dump({cls: {n: [{"cpu": x["cpu_seconds"], "tok": sum(map(len, x["tokens"])), "k": x["k_per_step"]} for x in r] for n, r in by.items()} for cls, by in runs.items()}, open("/tmp/trace/variants_out.json", "w"))
