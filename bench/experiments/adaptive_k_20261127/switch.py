"""Does switching k cost? Fixed k=1, k=2 and a forced cycle 1,2 in lockstep; per-arm step CPU and yield."""
import collections
import statistics
import sys
import time

import specdec
from bench.common import chat_token_ids, load_prompts, resolve_model, set_threads
from bench.speed.e2e import reuse_target_weights, share_draft_weights
from specdec.spec_decode import adaptive as A

set_threads(1)
class Cycle(A.AdaptiveK):
    seq = (1, 2)
    def __init__(self, *a, **k):
        super().__init__(*a, **k); self.n = 0
    def choose_arm(self, seq_id, batch_size, k_cap, trees=True):
        super().choose_arm(seq_id, batch_size, k_cap, trees); self.n += 1
        return A.Arm(self.seq[self.n % len(self.seq)])
import json

variants = json.loads(sys.argv[4]) if len(sys.argv) > 4 else {"cycle12": {"cls": "cycle"}}
def mk(name):
    ad = name in variants
    k = 4 if ad else int(name[2:])
    spec = specdec.SpeculativeConfig(method="draft_model", draft_model=resolve_model("qwen-0.5b"), adaptive=ad, num_speculative_tokens=k, draft_quantization="int4")
    return specdec.LLM(resolve_model("qwen-1.5b"), dtype="bfloat16", quantization="int8", max_model_len=2048, num_kv_blocks=256, speculative=spec)
cls = sys.argv[2] if len(sys.argv) > 2 else "prose"
names = sys.argv[5].split(",") + list(variants) if len(sys.argv) > 5 else ["k=1", "k=2"] + list(variants)
engines = {names[0]: mk(names[0])}
with reuse_target_weights(engines[names[0]]), share_draft_weights():
    for n in names[1:]: engines[n] = mk(n)
decs = []
for n, kw in variants.items():
    dec = engines[n].engine.speculative; kw = dict(kw); K = Cycle if kw.pop("cls", None) == "cycle" else A.AdaptiveK
    dec._new_adaptive = lambda dec=dec, kw=kw, K=K: K(dec.k_max, dec.cost_model, **kw)
    dec.reset_adaptive(); decs.append(dec)
ids = chat_token_ids(engines[names[0]].engine.tokenizer, load_prompts([cls], 1)[cls][0].text)
params = specdec.SamplingParams(temperature=0, max_tokens=int(sys.argv[1]), ignore_eos=True)
for llm in engines.values(): llm.generate(prompt_token_ids=[ids], sampling_params=specdec.SamplingParams(temperature=0, max_tokens=8))
for rep in range(int(sys.argv[3]) if len(sys.argv) > 3 else 2):
    for dec in decs: dec.reset_adaptive()
    state = {}
    for n, llm in engines.items():
        llm.engine.add_request(prompt_token_ids=ids, params=params)
        state[n] = dict(per=collections.defaultdict(list), acc=collections.defaultdict(list), n_prev=0, total=0.0, done=False)
    while not all(s["done"] for s in state.values()):
        name = min((n for n in names if not state[n]["done"]), key=lambda n: state[n]["n_prev"])
        s = state[name]; eng = engines[name].engine
        t = time.thread_time(); outs = eng.step(); dt = time.thread_time() - t; s["total"] += dt
        ks = None
        n = len(outs[0].outputs[0].token_ids) if outs else s["n_prev"]
        if outs and outs[0].finished: s["done"] = True
        m = outs[0].metrics if outs else {}
        kps = m.get("k_per_step", []); arm = kps[-1] if len(kps) > s.get("nk", 0) else -1; s["nk"] = len(kps)
        s["per"][arm].append(dt); s["acc"][arm].append(n - s["n_prev"]); s["n_prev"] = n
    for n in names:
        s = state[n]; tot = sum(len(v) for v in s['per'].values())
        print(rep, n, f"{s['n_prev'] / s['total']:.2f} tok/s", {a: (len(v), round(1000 * statistics.mean(v), 1), round(statistics.mean(s['acc'][a]), 2)) for a, v in sorted(s['per'].items())}, flush=True)
