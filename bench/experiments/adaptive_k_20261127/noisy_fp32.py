import json
import statistics
import sys

sys.path.insert(0, "/tmp/exp")
import adaptive_old
import sim
from variants_lib import MinRounds

c = 0.33; v = [1.0, 1.072, 0.754, 0.775, 0.696]
sim.COST.update({k: 100 * (k * c + v[k]) for k in range(5)}); sim.DRAFT_MS = 33
m = json.load(open(sys.argv[1]))["match"]
sigma = float(sys.argv[2]) if len(sys.argv) > 2 else 0.1
best = max(sim.simulate(m, sim.Fixed(k))[0] for k in range(5))
cands = {"old": dict(cls=adaptive_old.AdaptiveK), "new": {}, "new_o1": dict(optimism=1.0), "min8": dict(cls=MinRounds),
         "min8_d1": dict(cls=MinRounds, decay=1.0), "new_d1": dict(decay=1.0)}
for n, kw in cands.items():
    kw = dict(kw); cls = kw.pop("cls", sim.AdaptiveK)
    r = [sim.simulate(m, sim.NoisyAdaptive(cls, seed=s, sigma=sigma, **kw)) for s in range(20)]
    rat = sorted(x[0] / best for x in r)
    plain = statistics.mean(x[1].get(0, 0) for x in r)
    print(f"{n:8s} median {statistics.median(rat):.3f} min {rat[0]:.3f} p25 {rat[5]:.3f} mean plain steps {plain:.1f}")
