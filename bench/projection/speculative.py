"""Projected GPU speedup: acceptance measured on CPU with real weights, forward costs from a GPU (or a roofline).

Speculative decoding's speedup factors into what the models agree on (acceptance: a property of the weights and
the prompts, the same on any device up to rounding) and what forwards cost (c = draft / target forward, v(k) =
target forward of k + 1 tokens / of 1 token: properties of the device). This script joins the two:

- acceptance, tau, the share f of steps that speculated and the mean draft length k_bar come from ``bench.speed.e2e``
  result files measured on this CPU (``bench/results/e2e_*.json``, default: the Qwen2.5-Coder 1.5B/0.5B draft-model
  run and the SmolLM2-135M prompt-lookup run);
- the model sizes the roofline needs come from the result file itself (``meta["target_config"]`` /
  ``meta["draft_config"]``, recorded by ``bench.speed.e2e`` since these fields exist), else from ``KNOWN_CONFIGS`` (the
  published configs of the models the recorded runs used), else from the model folder's ``config.json``; never
  silently from nothing (a draft model whose sizes are unknown is an error, not c = 0);
- c and v(k) come from a GPU run of ``python -m bench.gpu`` (``--gpu-e2e DIR/e2e.json``: the Llama-3.2-3B/1B-shaped
  random pair at batch 1, whose size ratio 0.385 is close to the Qwen pair's 0.32) when one exists, and otherwise
  from a **memory roofline**: at batch 1 a decode forward streams every weight once, so c = draft bytes / target
  bytes and v(k) = 1 (k + 1 tokens read the same weights; far from compute-bound). The roofline ignores kernel
  launches and host work, which on a GPU are of the same order as a 1B model's forward without CUDA graphs, so it
  is an upper bound on the speedup, not a measurement.

The prediction is the "mix" formula of ``bench.speed.e2e`` (``round_mix``: the measured share of speculating steps,
their tau and mean draft length, each costing k_bar c + v(k_bar)), and beside it Theorem 3.8 with v(k) ("Thm+v(k)").

    python -m bench.projection.speculative [--results FILE ...] [--gpu-e2e e2e.json] [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from bench.common import RESULTS_DIR as RESULTS
from bench.speed.e2e import improvement, round_mix

DEFAULT_RESULTS = [
    RESULTS / "e2e_Qwen2.5-Coder-1.5B-Instruct_Qwen2.5-Coder-0.5B-Instruct_draft_model_k4_b1_T0_t1.json",
    RESULTS / "e2e_SmolLM2-135M-Instruct_prompt_lookup_k4_b1_T0_t1.json",
]
# Llama-3.2-1B / -3B shapes (bench/gpu_steps/models.py), tied embeddings: the design's pair.
LLAMA_3_2 = {
    "1B": dict(hidden_size=2048, num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8,
               intermediate_size=8192, vocab_size=128256, tie_word_embeddings=True),
    "3B": dict(hidden_size=3072, num_hidden_layers=28, num_attention_heads=24, num_key_value_heads=8,
               intermediate_size=8192, vocab_size=128256, tie_word_embeddings=True),
}


# The published config.json values (the Qwen/Qwen2.5-Coder-*-Instruct repositories; the same shapes as
# bench/dtype/linear.py's qw_* rows) of the models the recorded runs in bench/results used, by folder name: the
# recorded results predate meta["target_config"], and the folders they name live in a cache a new machine lacks.
KNOWN_CONFIGS = {
    "Qwen2.5-Coder-1.5B-Instruct": dict(hidden_size=1536, num_hidden_layers=28, num_attention_heads=12,
                                        num_key_value_heads=2, intermediate_size=8960, vocab_size=151936,
                                        tie_word_embeddings=True),
    "Qwen2.5-Coder-0.5B-Instruct": dict(hidden_size=896, num_hidden_layers=24, num_attention_heads=14,
                                        num_key_value_heads=2, intermediate_size=4864, vocab_size=151936,
                                        tie_word_embeddings=True),
}


def streamed_parameters(config: dict) -> int:
    """Weights a batch-1 decode forward reads: every layer's projections and the LM head (the embedding lookup
    reads one row; a tied embedding is read once, as the head). Norms and biases are negligible and left out."""
    hidden, layers = config["hidden_size"], config["num_hidden_layers"]
    head_dim = config.get("head_dim") or hidden // config["num_attention_heads"]
    q = config["num_attention_heads"] * head_dim
    kv = config["num_key_value_heads"] * head_dim
    per_layer = hidden * q + 2 * hidden * kv + q * hidden + 3 * hidden * config["intermediate_size"]
    return layers * per_layer + config["vocab_size"] * hidden


def roofline_costs(target_config: dict | None, draft_config: dict | None, k: int) -> dict:
    """c = draft bytes / target bytes (same dtype), v(j) = 1: the memory roofline at batch 1."""
    c = 0.0 if draft_config is None else streamed_parameters(draft_config) / streamed_parameters(target_config)
    return {"source": "roofline (batch 1, weights streamed once per forward)", "c": c, "v": [1.0] * k}


def gpu_costs(e2e: dict, pair: str = "random", batch: str = "1") -> dict | None:
    """c and v(j), j = 1..k, of ``bench.gpu``'s e2e step (the 3B/1B-shaped random pair at batch 1; v(j) is
    interpolated linearly from v(k) when a file holds v(k) only)."""
    try:
        costs = e2e["pairs"][pair]["batches"][batch]["costs"]
    except (KeyError, TypeError):
        return None
    k = e2e.get("k", 4)
    v = costs.get("v") or [1.0 + (costs["v_k"] - 1.0) * j / k for j in range(1, k + 1)]
    return {"source": f"GPU ({e2e.get('device', '?')}, bench.gpu e2e, pair {pair}, batch {batch})",
            "c": costs["c"], "v": list(v)}


def read_config(path: str | None) -> dict | None:
    if not path:
        return None
    try:
        return json.loads((Path(path) / "config.json").read_text())
    except (OSError, ValueError):
        return None


def model_config(meta: dict, role: str) -> dict | None:
    """The sizes of a result's ``role`` model ("target" or "draft"): recorded in ``meta``, else ``KNOWN_CONFIGS`` by
    folder name, else the folder's ``config.json``. None when the result has no such model (a model-free drafter);
    ``ValueError`` when it has one whose sizes are nowhere."""
    path = meta.get(role)
    if not path:
        return None
    found = meta.get(f"{role}_config") or KNOWN_CONFIGS.get(os.path.basename(os.path.normpath(path))) or \
        read_config(path)
    if not found:
        raise ValueError(f"no sizes for the {role} model {path}: the result does not record {role}_config, "
                         f"bench.projection.speculative.KNOWN_CONFIGS does not know {os.path.basename(path)!r} and "
                         f"{path}/config.json is not readable")
    return found


def project(result_path: Path, costs_for) -> list[dict]:
    """One row per prompt class of a ``bench.speed.e2e`` result file (batch 1)."""
    data = json.loads(result_path.read_text())
    meta, k = data["meta"], data["meta"]["k"]
    costs = costs_for(meta, k)
    rows = []
    for cls, r in sorted(data["phase_a"]["1"].items()):
        v = costs["v"]
        rows.append({
            "run": f"{os.path.basename(meta['target'])} / {meta['method']}"
                   + (f" ({os.path.basename(meta['draft'])})" if meta.get("draft") else ""),
            "class": cls, "k": k, "alpha": r.get("alpha"), "tau": r.get("tau"),
            "f": r.get("speculating_step_fraction"), "k_bar": r.get("mean_draft_length"),
            "cpu_speedup": r.get("speedup"), "cost_source": costs["source"], "c": costs["c"], "v_k": v[-1],
            "predicted_mix": round_mix(r, k, costs["c"], v),
            "predicted_thm_v_k": improvement(r.get("alpha"), k, costs["c"], v[-1]),
        })
    return rows


def markdown(rows: list[dict]) -> str:
    def f(x, d=2):
        return "-" if x is None else (f"{x:.{d}f}" if isinstance(x, float) else str(x))
    lines = ["| run | class | alpha (CPU) | tau (CPU) | f | CPU speedup | c | v(k) | cost source | predicted (mix) "
             "| predicted (Thm+v(k)) | measured on GPU |", "|" + "---|" * 12]
    for r in rows:
        lines.append(f"| {r['run']} | {r['class']} | {f(r['alpha'])} | {f(r['tau'])} | {f(r['f'])} | "
                     f"{f(r['cpu_speedup'])}x | {f(r['c'], 3)} | {f(r['v_k'])} | {r['cost_source']} | "
                     f"{f(r['predicted_mix'])}x | {f(r['predicted_thm_v_k'])}x | - |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--results", nargs="+", type=Path, default=DEFAULT_RESULTS,
                        help="bench.speed.e2e result files (acceptance measured on CPU)")
    parser.add_argument("--gpu-e2e", type=Path, help="bench.gpu's e2e.json: GPU-measured c and v(k)")
    parser.add_argument("--json", type=Path, help="also write the rows as JSON here")
    args = parser.parse_args(argv)
    gpu = gpu_costs(json.loads(args.gpu_e2e.read_text())) if args.gpu_e2e else None

    def costs_for(meta: dict, k: int) -> dict:
        if meta.get("draft") is None:  # model-free drafter: nothing to run on the device
            return {**roofline_costs(None, None, k), "source": "model-free (c = 0), v(k) = 1 (roofline)"} \
                if gpu is None else {**gpu, "c": 0.0}
        if gpu is not None:
            return gpu
        return roofline_costs(model_config(meta, "target"), model_config(meta, "draft"), k)

    rows = [row for path in args.results for row in project(path, costs_for)]
    llama_c = streamed_parameters(LLAMA_3_2["1B"]) / streamed_parameters(LLAMA_3_2["3B"])
    print(markdown(rows))
    print(f"\nLlama-3.2-1B / -3B roofline c = {llama_c:.3f} (the design's pair; not run on CPU here).")
    if args.json:
        args.json.write_text(json.dumps({"rows": rows, "llama_3_2_roofline_c": llama_c}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
