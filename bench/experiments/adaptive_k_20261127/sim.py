import json
import sys
from collections import Counter

sys.path.insert(0, "/work/main")
from specdec.spec_decode.adaptive import AdaptiveK

COST = {0: 110, 1: 143, 2: 182, 3: 215, 4: 250}
class Table:
    def draft_cost(self, b): return 0.0
    def verify_cost(self, k, b): return COST[k] / COST[0]
data = json.load(open("/tmp/exp/oracle_256.json"))
def run_len(match, p, k):
    a = 0
    while a < k and p + a < len(match) and match[p + a]:
        a += 1
    return a
def simulate(match, policy, n=None):
    """policy(history) -> k; returns tok/s, k counts, yield per k."""
    n = n or len(match)
    p, t, ks, yields = 1, 0.0, Counter(), Counter()
    pol = policy()
    while p < n:
        k = pol.choose()
        a = run_len(match, p, k)
        pol.observe(k, a)
        p += a + 1; t += COST[k]; ks[k] += 1; yields[k] += a + 1
    return n / t * 1000, ks, {k: round(yields[k] / ks[k], 2) for k in ks}
class Fixed:
    def __init__(self, k): self.k = k
    def __call__(self): return self
    def choose(self): return self.k
    def observe(self, k, a): pass
class Adaptive:
    def __init__(self, cls=AdaptiveK, **kw): self.kw, self.cls = kw, cls
    def __call__(self):
        o = Adaptive(self.cls, **self.kw); o.ada = self.cls(4, Table(), **self.kw); return o
    def choose(self): return self.ada.choose(0, 1, 4)
    def observe(self, k, a): self.ada.observe(0, k, a)
def report(policies, classes=("code", "json", "copy", "prose"), verbose=False):
    rows = {}
    for cls in classes:
        m = data[cls]["match"]
        res = {name: simulate(m, pol) for name, pol in policies.items()}
        best = max(v[0] for n, v in res.items() if n.startswith("k="))
        rows[cls] = {n: v[0] / best for n, v in res.items()}
        print(cls, " ".join(f"{n}={v[0]:.2f}({v[0]/best:.3f})" for n, v in res.items()))
        if verbose:
            for n, v in res.items():
                if not n.startswith("k="): print("    ", n, dict(sorted(v[1].items())), v[2])
    return rows
if __name__ == "__main__":
    pols = {f"k={k}": Fixed(k) for k in range(5)}
    pols["ad"] = Adaptive()
    pols["o0_e0"] = Adaptive(optimism=0, explore_every=0)
    pols["o0"] = Adaptive(optimism=0)
    pols["e0"] = Adaptive(explore_every=0)
    report(pols, verbose=True)

import random

from specdec.spec_decode.cost_model import MeasuredCostModel

DRAFT_MS = 25
class NoisyAdaptive(Adaptive):
    """The policy sees a MeasuredCostModel fed noisy timings of what it chose (lognormal sigma, rare outliers)."""
    def __init__(self, cls=AdaptiveK, seed=0, sigma=0.05, **kw):
        super().__init__(cls, **kw); self.seed, self.sigma = seed, sigma
    def __call__(self):
        o = NoisyAdaptive(self.cls, self.seed, self.sigma, **self.kw)
        o.rng = random.Random(self.seed); o.costs = MeasuredCostModel()
        for n in range(1, 6):  # calibration: every window length and the draft step, 3 times
            for _ in range(3):
                o.costs.observe_target(1, n, o.noisy(COST[n - 1] - DRAFT_MS * (n - 1)))
        for _ in range(3):
            o.costs.observe_draft(1, o.noisy(DRAFT_MS))
        o.ada = self.cls(4, o.costs, **self.kw); return o
    def noisy(self, ms):
        x = ms * self.rng.lognormvariate(0, self.sigma)
        return x * (1.5 if self.rng.random() < 0.03 else 1.0) / 1000
    def observe(self, k, a):
        self.costs.observe_target(1, k + 1, self.noisy(COST[k] - DRAFT_MS * k))
        for _ in range(max(k - 1, 0)):
            self.costs.observe_draft(1, self.noisy(DRAFT_MS))
        self.ada.observe(0, k, a)
