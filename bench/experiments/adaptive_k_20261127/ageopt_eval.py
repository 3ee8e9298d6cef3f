import sys, math; sys.path.insert(0,'tests'); sys.path.insert(0,'bench/experiments/adaptive_k_20261127')
import adaptive_old
import test_adaptive_traces as T

from specdec.spec_decode.adaptive import AdaptiveK


class AgeOpt(AdaptiveK):
    def __init__(self, *a, age_w=None, **k):
        super().__init__(*a, **k)
    def position_acceptance(self, seq_id, optimistic=False):
        rates = super().position_acceptance(seq_id, False)
        if not optimistic or not self.optimism: return rates
        st = self._state.get(seq_id); n = st.rounds if st else 0
        return [min(1.0, r + self.optimism * math.sqrt(r * (1 - r) / (n + self.prior_weight))) for r in rates]
class P(T.Adaptive):
    def __init__(self, cls=AdaptiveK, **kw): self.ada = cls(k_max=T.K_MAX, cost_model=T.StepTable(), **kw)
bf16 = dict(T.STEP_MS)
c = 0.33; v = [1.0, 1.072, 0.754, 0.775, 0.696]
fp32 = {k: 100 * (k * c + v[k]) for k in range(5)}
pols = {"old": lambda: P(adaptive_old.AdaptiveK), "new": lambda: P(), "age1": lambda: P(AgeOpt, optimism=1.0), "age.7": lambda: P(AgeOpt, optimism=0.7), "new.7": lambda: P(optimism=0.7)}
for cname, costs in (("bf16", bf16), ("fp32", fp32)):
  T.STEP_MS = costs
  for n in (64, 128, 256):
    for pn, mk in pols.items():
      d = {}
      for name, m in T.TRACES['match'].items():
        m = m[:n]; best = max(T.replay(m, T.Fixed(k)) for k in range(T.K_MAX + 1)); d[name] = T.replay(m, mk()) / best
      bc = T.by_class(d)
      print(cname, n, f"{pn:6s}", " ".join(f"{k}={x:.3f}" for k, x in bc.items()), f"min class {min(bc.values()):.3f} min text {min(d.values()):.3f}")
