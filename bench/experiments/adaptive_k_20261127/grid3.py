import contextlib
import io
import json
import sys

sys.path.insert(0, "/tmp/exp")
import sim
from sim import *

files = sys.argv[1].split(",")
data = {}
for f in files: data.update(json.load(open(f)))
sim.data = data
classes = sorted(data)
seeds = int(sys.argv[3]) if len(sys.argv) > 3 else 3
cands = eval(sys.argv[2])  # name -> kwargs
pols = {f"k={k}": Fixed(k) for k in range(5)}
for n, kw in cands.items():
    for s in range(seeds):
        pols[f"{n}#{s}"] = NoisyAdaptive(seed=s, **kw)
with contextlib.redirect_stdout(io.StringIO()):
    rows = report(pols, classes=classes)
print("classes", " ".join(classes))
for n in cands:
    per = {c: sum(rows[c][f"{n}#{s}"] for s in range(seeds)) / seeds for c in classes}
    by = {}
    for c in classes: by.setdefault(c.rstrip("0123456789"), []).append(per[c])
    print(f"{n:22s}", " ".join(f"{per[c]:.3f}" for c in classes), "| means", " ".join(f"{k}={sum(v)/len(v):.3f}" for k, v in by.items()), f"min={min(per.values()):.3f}")
