"""A memory-roofline projection of quantised decoding on a GPU for the design's pair (Llama-3.2-1B drafting
Llama-3.2-3B): bytes streamed per batch-1 decode and the tokens/s that bandwidth allows, per format, and the
speculative speedup the same roofline predicts at a few acceptance rates.

    python -m bench.projection.quant [--bandwidth-gbs 3350] [--alpha 0.6 0.7 0.8] [--k 4] [--json OUT]

**A bound, not a measurement.** At batch 1 a decode forward reads every weight once, so tokens/s <= bandwidth /
bytes per forward; kernel launches, host work, attention and the KV cache are left out, and the quantised kernel
is assumed to stream its weights at the same bandwidth as bf16 - which specdec's Triton kernel has **not** been
shown to do (the third GPU run, bench/results/gpu_h200_20261126_run3/README.md: the first version ran at 2-7%
of cuBLAS bf16; the redesigned one is unmeasured). The default bandwidth is the H100 SXM's nominal 3.35 TB/s.

Bytes per weight in specdec's formats (``specdec/model/quant/formats.py``, as the CUDA path holds them): bf16 2;
int8 per output channel 1 + 4 / K (an fp32 scale per row); int4 group 32 0.5 + 8 / 32 (fp32 scale and offset per
group) = 0.75. A tied LM head stays bf16 unless ``quantize_lm_head`` (the ``+head`` rows). Speculation: c = draft
bytes / target bytes, v(k) = 1 (the k + 1 rows read the same weights), Theorem 3.8's (1 - a^(k+1)) / ((1 - a)(k c +
1)) at per-token acceptance a; the draft in the same format as the target.
"""

from __future__ import annotations

import argparse
import json
import sys

from bench.common import print_table
from bench.projection.speculative import streamed_parameters
from bench.speed.e2e import improvement

# the published configs (meta-llama/Llama-3.2-{1B,3B}, config.json): both tie the LM head to the embedding
LLAMA_32 = {
    "Llama-3.2-1B": dict(hidden_size=2048, num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8,
                         head_dim=64, intermediate_size=8192, vocab_size=128256, tie_word_embeddings=True),
    "Llama-3.2-3B": dict(hidden_size=3072, num_hidden_layers=28, num_attention_heads=24, num_key_value_heads=8,
                         head_dim=128, intermediate_size=8192, vocab_size=128256, tie_word_embeddings=True),
}
FORMATS = ("bf16", "int8", "int8+head", "int4", "int4+head")


def bytes_per_weight(fmt: str, in_features: int) -> float:
    """Bytes one weight of a linear takes in ``fmt`` ("bf16", "int8", "int4"; a "+head" suffix is ignored here)."""
    base = fmt.removesuffix("+head")
    if base == "bf16":
        return 2.0
    if base == "int8":
        return 1.0 + 4.0 / in_features
    if base == "int4":
        return 0.5 + 8.0 / 32
    raise ValueError(f"unknown format {fmt!r}; known: {FORMATS}")


def streamed_bytes(config: dict, fmt: str) -> float:
    """Bytes a batch-1 decode forward of ``config`` reads in ``fmt``: the layers' linears in the format, the LM head
    in it too when untied or with "+head", else in bf16."""
    head = config["vocab_size"] * config["hidden_size"]
    layers = streamed_parameters(config) - head
    per = bytes_per_weight(fmt, config["hidden_size"])
    head_quantised = fmt.endswith("+head") or not config.get("tie_word_embeddings", False)
    return layers * per + head * (per if head_quantised else 2.0)


def project(bandwidth_gbs: float, alphas: list[float], k: int) -> list[dict]:
    rows = []
    target, draft = LLAMA_32["Llama-3.2-3B"], LLAMA_32["Llama-3.2-1B"]
    for fmt in FORMATS:
        t_bytes, d_bytes = streamed_bytes(target, fmt), streamed_bytes(draft, fmt)
        c = d_bytes / t_bytes
        rows.append({"format": fmt, "target_gb": t_bytes / 1e9, "draft_gb": d_bytes / 1e9,
                     "target_tok_s_bound": bandwidth_gbs * 1e9 / t_bytes,
                     "draft_tok_s_bound": bandwidth_gbs * 1e9 / d_bytes, "c": c,
                     "speedup": {a: improvement(a, k, c) for a in alphas}})
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.projection.quant", description=__doc__.split("\n\n")[0])
    parser.add_argument("--bandwidth-gbs", type=float, default=3350.0, help="HBM bandwidth, GB/s (H100 SXM: 3350)")
    parser.add_argument("--alpha", type=float, nargs="+", default=[0.6, 0.7, 0.8])
    parser.add_argument("--k", type=int, default=4)
    parser.add_argument("--json", default=None, help="also write the rows here")
    args = parser.parse_args(argv)
    if args.bandwidth_gbs <= 0 or args.k < 1 or not all(0 <= a <= 1 for a in args.alpha):
        parser.error("--bandwidth-gbs must be > 0, --k >= 1 and every --alpha in [0, 1]")
    rows = project(args.bandwidth_gbs, args.alpha, args.k)
    print(f"memory roofline at {args.bandwidth_gbs:.0f} GB/s, batch 1, Llama-3.2-3B target / 1B draft, k={args.k} "
          "(a bound: see the module docstring)")
    print_table([[r["format"], round(r["target_gb"], 2), round(r["target_tok_s_bound"]),
                  round(r["draft_tok_s_bound"]), round(r["c"], 3), *(round(r["speedup"][a], 2) for a in args.alpha)]
                 for r in rows], ["format", "3B GB", "3B tok/s <=", "1B tok/s <=", "c",
                                  *(f"spec a={a}" for a in args.alpha)])
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump({"bandwidth_gbs": args.bandwidth_gbs, "k": args.k, "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
