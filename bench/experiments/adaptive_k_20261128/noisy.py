"""Adaptive-k rules replayed on acceptance traces with noisy measured costs (experiment, 2026-11-28).

    PYTHONPATH=. python bench/experiments/adaptive_k_20261128/noisy.py [TOKENS] [SIGMA] [SEEDS]

Traces: the float32 prose trace of the end-to-end prompt (bench/results/adaptive_k_20261127/oracle_fp32_prose_256.json)
and the 16 bf16 traces of tests/data/acceptance_traces_qwen.json. Costs: the median step times of the float32 run of
2026-11-28 (fp32_4classes_128.log: plain 420, k=1 704, k=2 649, k=3 747, k=4 891 ms), split as a draft step of
DRAFT_MS plus a verify forward; the rule sees a MeasuredCostModel calibrated (3 samples per window) and fed every
chosen round's time x lognormal(0, SIGMA), 3% of samples 1.5x."""
import json
import random
import statistics
import sys

from bench.acceptance.acceptance_trace import accepted_run
from specdec.spec_decode.adaptive import AdaptiveK
from specdec.spec_decode.cost_model import MeasuredCostModel

STEP_MS = {0: 420, 1: 704, 2: 649, 3: 747, 4: 891}
DRAFT_MS = 100


class ForgetWhileOff(AdaptiveK):
    """A plain step ages the request's counts by ``forget`` (the decay of a measured round by default)."""

    def __init__(self, *args, forget=None, **kwargs):
        super().__init__(*args, **kwargs)
        self.forget = self.decay if forget is None else forget

    def choose_arm(self, seq_id, batch_size, k_cap, trees=True):
        arm = super().choose_arm(seq_id, batch_size, k_cap, trees)
        st = self._state.get(seq_id)
        if arm.depth == 0 and st is not None:
            st.reached = [x * self.forget for x in st.reached]
            st.accepted = [x * self.forget for x in st.accepted]
        return arm


def noisy(rng, ms, sigma):
    return ms * rng.lognormvariate(0, sigma) * (1.5 if rng.random() < 0.03 else 1.0) / 1000


def replay(match, make, seed, sigma):
    """tok/s (noise-free prices) of a rule that sees noisy measured costs; and its plain steps."""
    rng, costs = random.Random(seed), MeasuredCostModel()
    for n in range(1, 6):
        for _ in range(3):
            costs.observe_target(1, n, noisy(rng, STEP_MS[n - 1] - DRAFT_MS * (n - 1), sigma))
    for _ in range(3):
        costs.observe_draft(1, noisy(rng, DRAFT_MS, sigma))
    ada = make(costs) if make else None
    pos, ms, plain = 1, 0.0, 0
    while pos < len(match):
        k = ada.choose(0, 1, 4) if ada else seed  # (fixed k: seed is k)
        a = accepted_run(match, pos, k)
        if ada:
            ada.observe(0, k, a)
            costs.observe_target(1, k + 1, noisy(rng, STEP_MS[k] - DRAFT_MS * k, sigma))
            for _ in range(k):
                costs.observe_draft(1, noisy(rng, DRAFT_MS, sigma))
        pos, ms, plain = pos + a + 1, ms + STEP_MS[k], plain + (k == 0)
    return len(match) / ms * 1000, plain


tokens = int(sys.argv[1]) if len(sys.argv) > 1 else 128
sigma = float(sys.argv[2]) if len(sys.argv) > 2 else 0.1
seeds = int(sys.argv[3]) if len(sys.argv) > 3 else 20
traces = {"fp32/prose": "".join(map(str, json.load(open(
    "bench/results/adaptive_k_20261127/oracle_fp32_prose_256.json"))["match"]))}
traces.update(json.load(open("tests/data/acceptance_traces_qwen.json"))["match"])
for rate in (0.1, 0.25, 0.4):  # synthetic: drafting pays from ~0.39 at these costs (k = 2)
    rng = random.Random(int(rate * 100))
    traces[f"bernoulli/{rate}"] = "".join(str(int(rng.random() < rate)) for _ in range(256))
rules = {"prior 1:1 (before)": lambda c: AdaptiveK(4, c, prior_accepted=1.0),
         "prior 2:1": lambda c: AdaptiveK(4, c, prior_accepted=2.0),
         "prior 2:1, forget 0.97 while off": lambda c: ForgetWhileOff(4, c, prior_accepted=2.0),
         "prior 2:1, forget 0.9 while off": lambda c: ForgetWhileOff(4, c, prior_accepted=2.0, forget=0.9),
         "prior 2:1, forget 0.8 while off": lambda c: ForgetWhileOff(4, c, prior_accepted=2.0, forget=0.8)}
print(f"{tokens} tokens, sigma {sigma}, {seeds} seeds; per trace median (lowest) over seeds of adaptive / best fixed k")
by_rule = {r: {} for r in rules}
for name, m in traces.items():
    m = m[:tokens]
    best = max(replay(m, None, k, 0.0)[0] for k in range(5))
    cells = []
    for rule, make in rules.items():
        res = [replay(m, make, s, sigma) for s in range(seeds)]
        rat = sorted(r[0] / best for r in res)
        by_rule[rule][name] = rat
        cells.append(f"{statistics.median(rat):.3f} ({rat[0]:.3f}, plain {statistics.mean(r[1] for r in res):.1f})")
    print(f"{name:24s} " + " | ".join(cells), flush=True)
for rule, d in by_rule.items():
    classes = sorted({n.split("/")[0] for n in d if not n.startswith("fp32")})
    cls_mean = {c: statistics.mean(statistics.median(v) for n, v in d.items() if n.startswith(c + "/")) for c in classes}
    print(f"{rule:30s} " + " ".join(f"{c}={v:.3f}" for c, v in cls_mean.items()),
          f"fp32 prose median {statistics.median(d['fp32/prose']):.3f} mean {statistics.mean(d['fp32/prose']):.3f} "
          f"lowest {min(d['fp32/prose']):.3f}")
