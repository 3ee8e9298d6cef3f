from specdec.spec_decode.adaptive import AdaptiveK


class Hyst(AdaptiveK):
    """Stay on the current arm unless another is valued (1 + h) times more."""
    def __init__(self, *a, hyst=0.05, **k):
        super().__init__(*a, **k); self.hyst = hyst; self.cur = {}
    def _best(self, seq_id, batch_size, arms):
        best = super()._best(seq_id, batch_size, arms)
        cur = self.cur.get(seq_id)
        if cur is not None and cur in arms and self.value(seq_id, batch_size, best) <= (1 + self.hyst) * self.value(seq_id, batch_size, cur):
            return cur
        return best
    def choose_arm(self, seq_id, batch_size, k_cap, trees=True):
        arm = super().choose_arm(seq_id, batch_size, k_cap, trees)
        self.cur[seq_id] = arm
        return arm
class AgeOpt(AdaptiveK):
    """Optimism from the request's age (rounds that reached position 1), not each position's own count."""
    def position_acceptance(self, seq_id, optimistic=False):
        rates = super().position_acceptance(seq_id, False)
        if not optimistic or not self.optimism:
            return rates
        st = self._state.get(seq_id)
        n = st.rounds_seen[0] if st else 0
        import math
        return [min(1.0, r + self.optimism * math.sqrt(r * (1 - r) / (n + self.prior_weight))) for r in rates]
class MinRounds(AdaptiveK):
    """No plain step before position 1 has been measured by ``min_rounds`` chain rounds of this request."""
    def __init__(self, *a, min_rounds=8, **k):
        super().__init__(*a, **k); self.min_rounds = min_rounds
    def _best(self, seq_id, batch_size, arms):
        st = self._state.get(seq_id)
        if (st is None or st.rounds_seen[0] < self.min_rounds) and any(a.depth for a in arms):
            arms = [a for a in arms if a.depth]
        return super()._best(seq_id, batch_size, arms)
