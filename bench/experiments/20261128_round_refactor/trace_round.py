"""Count the files and cross-file hand-offs of one draft-model speculative round: LLMEngine.step traced with
sys.setprofile (Python calls only), from the step to the commit. Usage: python trace_round.py <repo root>"""
import os, sys, json, tempfile
root = os.path.abspath(sys.argv[1]); sys.path.insert(0, root); sys.path.insert(0, os.path.join(root, "tests"))
os.environ.setdefault("TRITON_INTERPRET", "1")
import torch; torch.set_num_threads(1)
import specdec
from specdec import SamplingParams, SpeculativeConfig
from tiny_models import make_tiny_model
d = tempfile.mkdtemp(); t, dr = os.path.join(d, "t"), os.path.join(d, "d")
make_tiny_model(t, "llama", seed=3); make_tiny_model(dr, "llama", seed=3, perturb_from=t, perturb_scale=0.15)
kw = dict(dtype="float32", block_size=4, max_model_len=128)
llm = specdec.LLM(t, speculative=SpeculativeConfig(draft_model=dr, num_speculative_tokens=3), kv_cache_memory_gb=0.05, **kw)
eng = llm.engine if hasattr(llm, "engine") else llm.llm_engine
p = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
eng.add_request(prompt_token_ids=[1, 5, 9, 13, 2, 7], params=p); eng.add_request(prompt_token_ids=[3, 4, 8, 11], params=p)
for _ in range(4):
    eng.step()  # prefill + warm rounds
ORCH = [os.path.join(root, "specdec", d) + os.sep for d in ("engine", "spec_decode", "runner", "cache")]
def orch(f): return any(f.startswith(o) for o in ORCH)
def mine(f): return f.startswith(os.path.join(root, "specdec") + os.sep) or f.startswith(os.path.join(root, "kernels") + os.sep)
files, edges, hops, entered = [], set(), 0, 0
sites = set()
def prof(frame, event, arg):
    global hops, entered
    if event != "call": return
    callee = frame.f_code.co_filename
    if not mine(callee): return
    back = frame.f_back
    while back is not None and not mine(back.f_code.co_filename): back = back.f_back
    if back is None or not orch(back.f_code.co_filename): return  # only calls made by the orchestration layers
    caller = os.path.relpath(back.f_code.co_filename, root); rel = os.path.relpath(callee, root)
    if rel not in files: files.append(rel)
    if caller != rel:
        hops += 1
        edges.add((caller, back.f_code.co_name, rel, frame.f_code.co_name))
        sites.add((caller, back.f_lineno, rel, frame.f_code.co_name))
sys.setprofile(prof); eng.step(); sys.setprofile(None)
pairs = {(a, c) for a, _, c, _ in edges}
within = {(a, b, c, d) for a, b, c, d in edges if orch(os.path.join(root, c))}
print(json.dumps({"files_touched": len(files), "orchestration_files": sum(orch(os.path.join(root, f)) for f in files),
                  "cross_file_calls_dynamic": hops, "unique_cross_file_edges(func->func)": len(edges),
                  "unique_edges_between_orchestration_files": len(within), "file_pairs": len(pairs),
                  "call_sites_engine_to_spec_decode": len({x for x in sites if x[0].startswith("specdec/engine") and x[2].startswith("specdec/spec_decode")}),
                  "call_sites_spec_decode_to_engine_or_back": len({x for x in sites if x[0].startswith("specdec/spec_decode") and x[2].startswith("specdec/engine")}),
                  "spec_decode_files": sum(f.startswith("specdec/spec_decode") for f in files)}, indent=1))
for f in files: print("  ", f)
if len(sys.argv) > 2:
    for x in sorted(sites):
        if x[0].startswith("specdec/engine") and x[2].startswith("specdec/spec_decode"): print("   SITE %s:%s -> %s:%s" % x)
    for e in sorted(edges): print("   %s:%s -> %s:%s" % e)
