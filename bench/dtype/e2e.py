"""End to end, fp32 vs bf16 (new: packed) vs bf16 (old: unpacked): plain and prompt-lookup speculative decoding.

    python -m bench.dtype.e2e --target smollm2 [--batch 1 4] [--classes code,prose] [--max-tokens 48] [--reps 3]
                              [--variants fp32,bf16,bf16_old] [--k 4] [--adaptive] [--force-prepack]

Greedy, ``max_tokens`` new tokens with ``ignore_eos`` (every variant generates the same number of tokens). At
batch 1 the first prompt of each class, at batch B the class's prompts cycled to B (``bench/prompts/<class>``,
rendered in the target's chat template and tokenised once, so the target folder needs a tokenizer with a chat
template). Variants:

  fp32      the target in float32 (``LLM(dtype="float32")``, packed linears where supported)
  bf16      the target in bfloat16 as the engine loads it now (prepacked linears, used from one row up)
  bf16_old  the same bfloat16 model with its packed copies detached before each of its runs (bf16 "before");
            with it in the run every model keeps its plain weights beside the packed copies (fp32 decodes by F.linear)

Each variant has a plain engine and a ``SpeculativeConfig(method="prompt_lookup", num_speculative_tokens=k)``
engine (``--adaptive`` adds one with ``adaptive=True``) sharing the target's weights; all live in one process
and run interleaved, every (variant, mode) once per (batch, class) per repetition, the order reversed every
repetition. Every engine is warmed up once first. Each run is timed by wall clock (``perf_counter``) and by
process CPU time (``process_time``, which load from other jobs does not inflate); reported: tokens per second,
median over ``--reps`` repetitions, spec/plain and bf16/fp32 ratios, whether the speculative tokens equal the
plain ones (lossless), and acceptance. One torch thread by default.
Results: ``bench/out/dtype_e2e_<target>_<variants>_<spec|ada>.json`` (``--record``: ``bench/results/``).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

import specdec
from bench.common import (
    add_record_flag,
    chat_token_ids,
    load_prompts,
    machine_info,
    median,
    resolve_model,
    set_threads,
    slug,
    write_json,
)
from bench.speed.e2e import reuse_target_weights
from specdec.model.linear import Linear, prepack_linears, prepack_supported
from specdec.tokenizer.tokenizer import Tokenizer

VARIANTS = ("fp32", "bf16", "bf16_old")


def build_engines(path: str, variants: list[str], modes: tuple[str, ...], k: int, kw: dict) -> tuple[dict, dict]:
    """``{(variant, mode): LLM}`` and, per variant, its target model. A dtype's engines share one target; with
    ``bf16`` in the run, ``bf16_old`` shares bf16's too (its packed copies are detached while it runs)."""
    configs = {"plain": None,
               "spec": specdec.SpeculativeConfig(method="prompt_lookup", num_speculative_tokens=k),
               "adaptive": specdec.SpeculativeConfig(method="prompt_lookup", num_speculative_tokens=k, adaptive=True)}
    engines, models = {}, {}
    for v in variants:
        dtype = "float32" if v == "fp32" else "bfloat16"
        if v == "bf16_old" and "bf16" in models:
            base = engines["bf16", "plain"]
        else:
            base = engines[v, "plain"] = specdec.LLM(path, dtype=dtype, **kw)
        with reuse_target_weights(base):
            for mode in modes:
                if (v, mode) not in engines:
                    engines[v, mode] = specdec.LLM(path, dtype=dtype, speculative=configs[mode], **kw)
        models[v] = base.engine.model
    return engines, models


def linears(model: torch.nn.Module) -> list[Linear]:
    return [m for m in model.modules() if isinstance(m, Linear)]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.dtype.e2e", description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", default="smollm2",
                        help="target model folder (with tokenizer and chat template), or smollm2 | qwen-0.5b | "
                             "qwen-1.5b")
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 4], help="requests per generate call")
    parser.add_argument("--classes", default="code,prose", help="comma-separated bench/prompts classes")
    parser.add_argument("--max-tokens", type=int, default=48, help="new tokens per request (ignore_eos)")
    parser.add_argument("--reps", type=int, default=3, help="interleaved repetitions (the median is reported)")
    parser.add_argument("--variants", default=",".join(VARIANTS),
                        help=f"comma-separated, from {', '.join(VARIANTS)}")
    parser.add_argument("--k", type=int, default=4, help="prompt lookup's num_speculative_tokens")
    parser.add_argument("--adaptive", action="store_true", help="also run prompt lookup with adaptive=True")
    parser.add_argument("--force-prepack", action="store_true",
                        help="LLM(prepack_weights=True) instead of the default (where supported and memory allows)")
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    add_record_flag(parser)
    args = parser.parse_args(argv)
    variants = args.variants.split(",")
    if unknown := sorted(set(variants) - set(VARIANTS)):
        parser.error(f"unknown variants {unknown}; choose from {', '.join(VARIANTS)}")
    modes = ("plain", "spec", "adaptive") if args.adaptive else ("plain", "spec")

    set_threads(args.threads)
    print(f"threads {torch.get_num_threads()}, torch {torch.__version__}", flush=True)
    path = resolve_model(args.target)
    tok = Tokenizer.from_dir(path)
    prompts = load_prompts(args.classes.split(","))
    ids = {c: [chat_token_ids(tok, p.text) for p in ps] for c, ps in prompts.items()}
    longest = max(len(p) for ps in ids.values() for p in ps)
    max_model_len = -(-(longest + args.max_tokens + args.k + 2) // 16) * 16
    kw = dict(max_model_len=max_model_len, num_kv_blocks=max(args.batch) * (max_model_len // 16 + 1) + 2)
    if args.force_prepack:
        kw["prepack_weights"] = True
    keep_plain = "bf16_old" in variants and not args.force_prepack
    if keep_plain:  # bf16_old runs without packed copies, so the plain weights must stay (not the engine default)
        kw["prepack_weights"] = False
    engines, models = build_engines(path, variants, modes, args.k, kw)
    if keep_plain:
        for v, model in models.items():
            if v != "bf16_old" and prepack_supported(next(model.parameters()).dtype, torch.device("cpu")):
                prepack_linears(model, required=True, release_weights=False)
    saved = {v: {m: (m.packed_weight, m.packed_bf16) for m in linears(models[v])} for v in variants}
    for v in variants:
        note = " (detached while it runs)" if v == "bf16_old" else ""
        print(f"{v} packed: {sum(pw is not None for pw, _ in saved[v].values())} / {len(saved[v])}{note}", flush=True)

    def set_pack(v: str) -> None:
        """Give the variant's target the packed copies it runs with (none for bf16_old)."""
        for m, (pw, pb) in saved[v].items():
            m.packed_weight, m.packed_bf16 = (None, False) if v == "bf16_old" else (pw, pb)

    warm = specdec.SamplingParams(temperature=0, max_tokens=4)
    for (v, _), llm in engines.items():
        set_pack(v)
        llm.generate(prompt_token_ids=[ids[next(iter(ids))][0]], sampling_params=warm)

    params = specdec.SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
    configs = [(v, mode, b, c) for b in args.batch for c in ids for v in variants for mode in modes]
    res = {cfg: {"wall": [], "cpu": [], "tokens": None, "accept": None} for cfg in configs}
    for rep in range(args.reps):
        for cfg in configs if rep % 2 == 0 else configs[::-1]:
            v, mode, b, c = cfg
            set_pack(v)
            group = [ids[c][i % len(ids[c])] for i in range(b)]
            w0, c0 = time.perf_counter(), time.process_time()
            outs = engines[v, mode].generate(prompt_token_ids=group, sampling_params=params)
            wall, cpu = time.perf_counter() - w0, time.process_time() - c0
            n = sum(len(o.outputs[0].token_ids) for o in outs)
            r = res[cfg]
            r["wall"].append(n / wall)
            r["cpu"].append(n / cpu)
            r["tokens"] = [list(o.outputs[0].token_ids) for o in outs]
            met = [o.metrics for o in outs]
            drafted, accepted = sum(m.get("drafted") or 0 for m in met), sum(m.get("accepted") or 0 for m in met)
            r["accept"] = {"drafted": drafted, "accepted": accepted,
                           "rate": round(accepted / drafted, 3) if drafted else None,
                           "rounds": sum(m.get("num_rounds") or 0 for m in met),
                           "target_forwards_seq0": met[0].get("target_forwards")}
        print("rep", rep, "done", time.strftime("%X"), flush=True)

    print(f"\n{args.target}, {torch.get_num_threads()} thread(s), greedy, max_tokens {args.max_tokens} (ignore_eos), "
          f"prompt_lookup k={args.k}, median of {args.reps} interleaved reps; tok/s by wall clock and by process CPU")
    print(f"{'batch':>5} {'class':>6} {'variant':>9} {'plain wall':>10} {'spec wall':>10} {'spec/plain':>10} "
          f"{'plain cpu':>10} {'spec cpu':>10} {'spec/plain':>10} {'lossless':>8}")
    summary = {}
    for b in args.batch:
        for c in ids:
            for v in variants:
                p, s = res[v, "plain", b, c], res[v, "spec", b, c]
                pw, sw, pc, sc = median(p["wall"]), median(s["wall"]), median(p["cpu"]), median(s["cpu"])
                same = p["tokens"] == s["tokens"]
                if args.adaptive:
                    a = res[v, "adaptive", b, c]
                    aw, ac = median(a["wall"]), median(a["cpu"])
                    a_same = a["tokens"] == p["tokens"]
                    summary[f"{b}/{c}/{v}/adaptive"] = dict(wall=aw, cpu=ac, lossless=a_same, accept=a["accept"])
                    print(f"{b:>5} {c:>6} {v:>9} adaptive: wall {aw:.2f} ({aw / pw:.2f}x plain) cpu {ac:.2f} "
                          f"({ac / pc:.2f}x plain) lossless {a_same} accept {a['accept']}")
                summary[f"{b}/{c}/{v}"] = dict(plain_wall=pw, spec_wall=sw, plain_cpu=pc, spec_cpu=sc, lossless=same,
                                               accept=s["accept"])
                print(f"{b:>5} {c:>6} {v:>9} {pw:10.2f} {sw:10.2f} {sw / pw:10.2f} {pc:10.2f} {sc:10.2f} "
                      f"{sc / pc:10.2f} {str(same):>8}")
            for v in variants:
                if v != "fp32" and "fp32" in variants:
                    for mode in modes:
                        a, bb = res["fp32", mode, b, c], res[v, mode, b, c]
                        print(f"      {c:>6} {v}/fp32 {mode}: wall {median(bb['wall']) / median(a['wall']):.2f} "
                              f"cpu {median(bb['cpu']) / median(a['cpu']):.2f}")
            for v in variants:
                print(f"      {c:>6} {v} spec acceptance: {res[v, 'spec', b, c]['accept']}")

    raw = {"|".join(map(str, cfg)): {"wall": r["wall"], "cpu": r["cpu"]} for cfg, r in res.items()}
    name = f"dtype_e2e_{slug(Path(args.target).name)}_{slug(args.variants)}_{'ada' if args.adaptive else 'spec'}"
    out = write_json(name, {"machine": machine_info(), "args": vars(args), "threads": torch.get_num_threads(),
                            "clock": ["perf_counter", "process_time"], "summary": summary, "raw": raw},
                     record=args.record)
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
