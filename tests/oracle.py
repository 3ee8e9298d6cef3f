"""The exact-distribution oracle of the lossless tests (tests/lossless/, tests/tp/): a tiny target over VOCAB
tokens and a perturbed draft, the exact joint of every continuation, and Pearson's chi-square against it.

transformers' LlamaForCausalLM loaded from the target's folder gives the logits of every prefix (the whole tree of
V^(m-1) prefixes, batched by length) and ``oracle_distribution`` re-implements the contract's standardization in
float64 (penalties -> temperature -> softmax -> top-k -> renormalise -> top-p -> renormalise -> min-p), which gives
the exact probability of each of the V^m continuations - independent of the library's sampling code.

Statistic: Pearson's chi-square of the empirical joint of tokens 1..m against the exact joint. Cells whose
expected count is below MIN_EXPECTED are pooled into one cell (topped up with the next-smallest cells if the
pool itself is below MIN_EXPECTED); a sample in a cell of exact probability 0 fails outright (statistic =
inf). The bound is the chi-square quantile at ALPHA = 1e-6 for the table's degrees of freedom (regularized
incomplete gamma, bisection). Simulating 200k multinomial tables from these exact joints, the pooled
statistic's tail runs 1.1-1.6x the nominal level at 1e-2..1e-4, so the false-alarm rate per table is a few
1e-6 at most. Every request is seeded and the engine's randomness is a pure function of (seed, position,
stream), so each run is deterministic: a test either always passes or always fails, never flakes.
"""

from __future__ import annotations

import itertools
import math
import time
from collections import Counter

import torch
from helpers import small_llm
from stats_helpers import chi2_isf
from tiny_models import make_tiny_model

import specdec
from specdec import SamplingParams

VOCAB = 4
PROMPT = [1, 2, 1]
N = 3000  # requests per run of the true engine
N_MUTANT = 1500  # requests per mutant run (their statistics land far above the bound)
ALPHA = 1e-6
MIN_EXPECTED = 10.0
FILTER_MARGIN = 1e-4  # no top-k / top-p / min-p decision of the oracle may be closer than this to its threshold

CONFIGS = {
    "temperature_1": {"temperature": 1.0},
    # top-k always drops the 4th token; top-p then keeps 2 tokens (~85% of rows) or 3, so the sets change
    "top_k_top_p": {"temperature": 0.8, "top_k": 3, "top_p": 0.83},
    "penalties": {"temperature": 0.9, "repetition_penalty": 1.4, "presence_penalty": 0.5, "frequency_penalty": 0.4},
}


def make_lossless_pair(root) -> tuple[str, str]:
    """A tiny target over VOCAB tokens and a perturbed draft of it, written under ``root``: (target, draft)."""
    target, draft = str(root / "target"), str(root / "draft")
    shape = {"vocab_size": VOCAB, "hidden_size": 32, "num_layers": 1, "num_heads": 4, "num_kv_heads": 2,
             "intermediate_size": 64, "max_position_embeddings": 64, "with_tokenizer": False}
    # A small output projection keeps the next-token distributions spread out (every cell gets mass).
    make_tiny_model(target, seed=1, lm_head_std=0.08, **shape)
    make_tiny_model(draft, seed=2, perturb_from=target, perturb_scale=1.5, **shape)
    return target, draft


def target_prefix_logits(target_dir: str, prompt: list[int], max_m: int) -> dict[tuple[int, ...], torch.Tensor]:
    """float64 next-token logits of transformers' target after ``prompt`` + every prefix of length < max_m."""
    import transformers

    model = transformers.LlamaForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()
    table = {}
    with torch.no_grad():
        for length in range(max_m):
            prefixes = list(itertools.product(range(VOCAB), repeat=length))
            ids = torch.tensor([prompt + list(p) for p in prefixes], dtype=torch.int64)
            logits = model(ids).logits[:, -1].double()
            table.update(zip(prefixes, logits))
    return table


def lossless_llm(target: str, spec: specdec.SpeculativeConfig) -> specdec.LLM:
    """The fp32 speculative LLM of the lossless tests (tiny KV cache, up to 256 requests per batch)."""
    return small_llm(target, dtype="float32", max_model_len=32, block_size=4, max_num_seqs=256,
                       kv_cache_memory_gb=0.02, speculative=spec)  # fmt: skip


def memoised(build):
    """``make(*key)``: ``build(*key)`` made once per key (one LLM per configuration for a whole module)."""
    made = {}

    def make(*key):
        if key not in made:
            made[key] = build(*key)
        return made[key]

    return make


def oracle_distribution(logits: torch.Tensor, context: list[int], output: list[int], cfg: dict) -> torch.Tensor:
    """The contract's standardization of one float64 logits row, written from the spec (not the library).

    ``context`` = prompt + output (repetition penalty), ``output`` = generated tokens (presence / frequency).
    Asserts that no filter decision lies within FILTER_MARGIN of its threshold, so fp32 rounding in the engine
    cannot flip one.
    """
    x = logits.clone()
    rep = cfg.get("repetition_penalty", 1.0)
    for t in set(context):
        x[t] = x[t] / rep if x[t] > 0 else x[t] * rep
    for t, c in Counter(output).items():
        x[t] -= cfg.get("frequency_penalty", 0.0) * c + cfg.get("presence_penalty", 0.0)
    p = torch.softmax(x / cfg.get("temperature", 1.0), dim=0)
    top_k = cfg.get("top_k", 0)
    if 0 < top_k < VOCAB:
        kth = p.sort(descending=True).values[top_k - 1]
        near = (p - kth).abs()
        assert bool((near[near > 0] > FILTER_MARGIN).all()), "a top-k decision is too close to call"
        p = torch.where(p >= kth, p, 0.0)
        p = p / p.sum()
    top_p = cfg.get("top_p", 1.0)
    if top_p < 1:
        above = torch.stack([p[p > p[v]].sum() for v in range(VOCAB)])  # mass ranked strictly above each token
        assert bool(((above - top_p).abs() > FILTER_MARGIN).all()), "a top-p decision is too close to call"
        p = torch.where((above < top_p) & (p > 0), p, 0.0)
        p = p / p.sum()
    min_p = cfg.get("min_p", 0.0)
    if min_p > 0:
        assert bool(((p - min_p * p.max()).abs() > FILTER_MARGIN).all()), "a min-p decision is too close to call"
        p = torch.where(p >= min_p * p.max(), p, 0.0)
        p = p / p.sum()
    return p


def exact_joint(prefix_logits: dict, cfg: dict, m: int, prompt: list[int] = PROMPT,
                allowed: list[set[int]] | None = None) -> torch.Tensor:
    """float64 ``[V] * m``: the exact probability of every continuation of ``prompt`` of length m
    (``prefix_logits`` must be the logits after that same prompt). ``allowed`` (a structured-output constraint):
    per output position the tokens it admits; the others' logits are -inf before the standardization."""
    def masked(prefix, logits):
        if allowed is None:
            return logits
        out = logits.clone()
        out[[t for t in range(VOCAB) if t not in allowed[len(prefix)]]] = -math.inf
        return out

    dist = {prefix: oracle_distribution(masked(prefix, logits), prompt + list(prefix), list(prefix), cfg)
            for prefix, logits in prefix_logits.items() if len(prefix) < m}
    joint = torch.ones([VOCAB] * m, dtype=torch.float64)
    for seq in itertools.product(range(VOCAB), repeat=m):
        joint[seq] = math.prod(float(dist[seq[:t]][seq[t]]) for t in range(m))
    assert abs(float(joint.sum()) - 1.0) < 1e-9
    return joint


# --- statistic and bound ---------------------------------------------------------------------------------------
def chi_square_test(counts: torch.Tensor, probs: torch.Tensor) -> tuple[float, float, int, int]:
    """(Pearson statistic, bound at ALPHA, degrees of freedom, samples in p = 0 cells); the statistic is inf
    when any sample lies in a cell of exact probability 0."""
    counts, probs = counts.flatten().double(), probs.flatten().double()
    impossible = int(counts[probs == 0].sum())
    expected = probs * counts.sum()
    big = expected >= MIN_EXPECTED
    small = (probs > 0) & ~big
    # If the pooled cell is itself too small, move the smallest remaining cells into it.
    for cell in sorted(big.nonzero().flatten().tolist(), key=lambda c: float(expected[c])):
        if not small.any() or float(expected[small].sum()) >= MIN_EXPECTED:
            break
        big[cell], small[cell] = False, True
    obs, exp = counts[big], expected[big]
    if small.any():
        obs = torch.cat([obs, counts[small].sum()[None]])
        exp = torch.cat([exp, expected[small].sum()[None]])
    assert float(exp.min()) >= MIN_EXPECTED and obs.numel() >= 2, "too few samples for a chi-square table"
    df = int(obs.numel()) - 1
    stat = math.inf if impossible else float(((obs - exp) ** 2 / exp).sum())
    return stat, chi2_isf(ALPHA, df), df, impossible


def run(llm, cfg: dict, m: int, n: int, label: str, prompt: list[int] = PROMPT) -> tuple[torch.Tensor, list[dict]]:
    """n seeded requests of ``prompt`` in one generate call: (counts ``[V] * m``, per-request metrics)."""
    params = [SamplingParams(seed=i, max_tokens=m, ignore_eos=True, **cfg) for i in range(n)]
    start = time.perf_counter()
    outs = llm.generate(prompt_token_ids=[prompt] * n, sampling_params=params)
    counts = torch.zeros([VOCAB] * m, dtype=torch.int64)
    for out in outs:
        tokens = out.outputs[0].token_ids
        assert len(tokens) == m and all(0 <= t < VOCAB for t in tokens), tokens
        counts[tuple(tokens)] += 1
    print(f"\n[{label}] generated {n} x {m} tokens in {time.perf_counter() - start:.1f}s", end="")
    return counts, [out.metrics for out in outs]


def check(label: str, counts: torch.Tensor, joint: torch.Tensor) -> tuple[float, float]:
    """Statistic and bound of ``counts`` against ``joint``, printed (visible with -s)."""
    stat, bound, df, impossible = chi_square_test(counts, joint)
    print(f"\n[{label}] chi-square {stat:.1f} vs bound {bound:.1f} (df={df}, alpha={ALPHA:g}, "
          f"N={int(counts.sum())}, samples in zero-probability cells: {impossible})", end="")
    return stat, bound
