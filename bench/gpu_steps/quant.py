"""Step quant: int8 / int4 weight-only linears on the GPU (quant.json) - the kernel, then the engine.

1. Kernel (``kernels/quant_matmul.py`` through ``QuantizedLinear``, the model's own module) against bf16
   ``F.linear`` (cuBLAS) on the linears of Llama-3.2-1B and 3B (fused QKV, o, fused gate/up, down, LM head) at
   1 / 5 / 16 rows (a decode, a k = 4 verification window, a batch): ``triton.testing.do_bench`` medians per
   Python call (``*_ms``, launch and planning included) and the GPU's work per call from CUDA graph replays over
   copies of the weight (``*_graph_ms``, ``bench.gpu_steps.graph_timing``: what the linear costs inside the
   engine's graphs; ``*_launch_overhead_ms`` = do_bench - graph), GB/s of the weight's own bytes (int8 1 B, int4
   0.5 B + scales / offsets, bf16 2 B per weight) from each against a measured device-to-device copy, and the
   largest difference from the torch reference (``QuantizedLinear.path_reference``: dequantise, fp32 matmul)
   relative to the reference's largest value - the kernel's correctness on a real GPU.
2. Engine: plain decoding of random-weight 1B- and 3B-shaped targets (bf16 checkpoints, ``bench.gpu_steps.models``)
   loaded as bf16 / ``quantization="int8"`` / ``"int4"``, batch 1 and 8, 128-id prompts, 64 new tokens
   (``ignore_eos``), one warm-up then 3 interleaved timed runs (median); every request checked (no error, all 64
   tokens). Then speculative decoding of the 3B-shaped target drafted by its own int4 copy (``draft_model="self"``,
   ``draft_quantization="int4"``, k = 4, greedy) against its plain decoding: c is what the int4 copy costs, the
   acceptance is what int4 rounding leaves of a random model's argmax (a random model's logits are nearly flat, so
   this is a floor, not a real model's acceptance).
Dry run: tiny shapes on CPU (the torch reference path), seconds.
"""

from __future__ import annotations

import gc
import statistics
import sys
import tempfile

import torch

import specdec
from bench.gpu_steps.common import copy_bandwidth_gbps, out_of_time, parse_args, synced_timed, write_json
from bench.gpu_steps.e2e import check_outputs
from bench.gpu_steps.graph_timing import copies, graph_columns
from bench.gpu_steps.kernels import time_ms
from bench.gpu_steps.models import LLAMA_1B, LLAMA_3B, TINY, write_random_llama
from specdec.model.quant.linear import QuantizedLinear


def linear_shapes(cfg: dict) -> dict[str, tuple[int, int]]:
    """name -> (N out, K in) of one layer's linears and the LM head, as the engine fuses them."""
    h, i = cfg["hidden_size"], cfg["intermediate_size"]
    head_dim = h // cfg["num_heads"]
    qkv = (cfg["num_heads"] + 2 * cfg["num_kv_heads"]) * head_dim
    return {"qkv": (qkv, h), "o": (h, h), "gate_up": (2 * i, h), "down": (h, i), "lm_head": (cfg["vocab_size"], h)}


def weight_bytes(module) -> int:
    return sum(t.numel() * t.element_size() for t in (module.qweight, module.scale, module.offset) if t is not None)


def quantized_copy(n: int, k: int, scheme: str, gen: torch.Generator) -> QuantizedLinear:
    """Another random ``[n, k]`` linear quantised with ``scheme``, prepared for the GPU path (graph timing's copies)."""
    w = torch.randn(n, k, generator=gen, device=gen.device) * 0.02  # (N, K) fp32
    module = QuantizedLinear.from_weight(w, None, scheme)
    module.prepare(w.device, cpu_path="weight_only", release=False)
    return module


def kernel_rows(args, cuda: bool, copy_gbps: float, rows: list[dict], save) -> None:
    dev = "cuda" if cuda else "cpu"
    models = {"tiny": TINY} if args.dry_run else {"Llama-3.2-1B": LLAMA_1B, "Llama-3.2-3B": LLAMA_3B}
    for model, cfg in models.items():
        for name, (n, k) in linear_shapes(cfg).items():
            if out_of_time(args, 15):
                return
            gen = torch.Generator(device=dev).manual_seed(n * 7 + k)
            w = torch.randn(n, k, generator=gen, device=dev) * 0.02  # (N, K) fp32
            w_bf16 = w.to(torch.bfloat16)
            quantized = {s: QuantizedLinear.from_weight(w, None, s) for s in ("int8", "int4")}
            for module in quantized.values():  # on CPU (dry run) the weight-only reference the GPU path mirrors
                module.prepare(w.device, cpu_path="weight_only", release=False)
            # graph timing (CUDA): the same linear over copies of its weight, so it reads them from HBM, not L2
            bf16_set = [w_bf16] + [(torch.randn(n, k, generator=gen, device=dev) * 0.02).to(torch.bfloat16)
                                   for _ in range(copies(2 * n * k) - 1 if cuda else 0)]  # fmt: skip
            quant_sets = {s: [q] + [quantized_copy(n, k, s, gen) for _ in range(copies(weight_bytes(q)) - 1)]
                          for s, q in quantized.items()} if cuda else {}  # fmt: skip
            for m in (1, 5, 16):
                x = torch.randn(m, k, generator=gen, device=dev).to(torch.bfloat16)  # (M, K)
                bf16_ms = time_ms(lambda x=x, w=w_bf16: torch.nn.functional.linear(x, w), cuda)
                row = {"model": model, "linear": name, "N": n, "K": k, "rows": m, "bf16_ms": bf16_ms,
                       "bf16_GBps": 2 * n * k / (bf16_ms * 1e-3) / 1e9}  # fmt: skip
                if cuda:
                    row.update(graph_columns("bf16", [lambda x=x, w=c: torch.nn.functional.linear(x, w)
                                                      for c in bf16_set], bf16_ms, 2 * n * k, copy_gbps))  # fmt: skip
                for scheme, module in quantized.items():
                    ms = time_ms(lambda x=x, module=module: module(x), cuda)
                    ref = module.path_reference(x)
                    got = module(x).float()
                    gbps = weight_bytes(module) / (ms * 1e-3) / 1e9
                    row.update({f"{scheme}_ms": ms, f"{scheme}_GBps": gbps,
                                f"{scheme}_pct_copy": 100 * gbps / copy_gbps,
                                f"{scheme}_speedup_vs_bf16": bf16_ms / ms,
                                f"{scheme}_rel_err": float((got - ref).abs().max() / ref.abs().max())})  # fmt: skip
                    if cuda:
                        row.update(graph_columns(scheme, [lambda x=x, q=q: q(x) for q in quant_sets[scheme]], ms,
                                                 weight_bytes(module), copy_gbps))  # fmt: skip
                        if isinstance(row[f"{scheme}_graph_ms"], float) and isinstance(row["bf16_graph_ms"], float):
                            row[f"{scheme}_graph_speedup_vs_bf16"] = row["bf16_graph_ms"] / row[f"{scheme}_graph_ms"]
                rows.append(row)
                print(f"{model} {name} {n}x{k} rows {m}: bf16 {bf16_ms:.4f} ms, int8 {row['int8_ms']:.4f} ms, "
                      f"int4 {row['int4_ms']:.4f} ms (err {row['int8_rel_err']:.1e} / {row['int4_rel_err']:.1e})",
                      flush=True)  # fmt: skip
                save()
            del quantized, w, w_bf16, bf16_set, quant_sets
            gc.collect()
            if cuda:
                torch.cuda.empty_cache()


def timed_runs(llms: dict[str, specdec.LLM], prompts, params, reps: int) -> dict[str, dict]:
    """One warm-up of each engine, then ``reps`` interleaved timed runs; median tok/s and the last outputs."""
    for llm in llms.values():
        check_outputs(llm.generate(prompt_token_ids=prompts, sampling_params=params), params.max_tokens, "warm-up")
    seconds: dict[str, list[float]] = {name: [] for name in llms}
    outs = {}
    for _ in range(reps):
        for name, llm in llms.items():
            t, outs[name] = synced_timed(lambda llm=llm: llm.generate(prompt_token_ids=prompts, sampling_params=params))
            check_outputs(outs[name], params.max_tokens, name)
            seconds[name].append(t)
    tokens = len(prompts) * params.max_tokens
    return {name: {"tok_s": tokens / statistics.median(s), "seconds": s, "outputs": outs[name]}
            for name, s in seconds.items()}  # fmt: skip


def engine_rows(args, cuda: bool, work: str, result: dict, save) -> None:
    dtype = torch.bfloat16 if cuda else torch.float32
    targets = {"tiny": TINY} if args.dry_run else {"Llama-3.2-1B": LLAMA_1B, "Llama-3.2-3B": LLAMA_3B}
    batches, prompt_len, max_tokens, reps = ([1, 2], 16, 8, 3) if args.dry_run else ([1, 8], 128, 64, 3)
    params = specdec.SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    kw = {"dtype": "bfloat16" if cuda else "float32", "max_model_len": prompt_len + max_tokens + 16, "seed": 0,
          "enable_prefix_caching": False}  # fmt: skip
    for model, cfg in targets.items():
        if out_of_time(args, 60 if cuda else 10):
            return
        path = write_random_llama(f"{work}/{model}", dtype=dtype, seed=11, **cfg)
        llms = {q or "bf16": specdec.LLM(path, quantization=q, **kw) for q in (None, "int8", "int4")}
        for batch in batches:
            gen = torch.Generator().manual_seed(batch)
            prompts = torch.randint(0, cfg["vocab_size"] - 8, (batch, prompt_len), generator=gen).tolist()
            runs = timed_runs(llms, prompts, params, reps)
            row = {"model": model, "batch": batch, "reps": reps, "max_tokens": max_tokens,
                   **{f"{name}_tok_s": r["tok_s"] for name, r in runs.items()}}  # fmt: skip
            for name in ("int8", "int4"):
                row[f"{name}_speedup"] = row[f"{name}_tok_s"] / row["bf16_tok_s"]
                same = sum(a.outputs[0].token_ids == b.outputs[0].token_ids
                           for a, b in zip(runs[name]["outputs"], runs["bf16"]["outputs"]))  # fmt: skip
                row[f"{name}_same_tokens_as_bf16"] = f"{same}/{batch}"
            result["plain"].append(row)
            print(f"{model} batch {batch}: " + ", ".join(f"{n} {r['tok_s']:.0f} tok/s" for n, r in runs.items()),
                  flush=True)
            save()
        if model == list(targets)[-1] and not out_of_time(args, 40 if cuda else 10):
            spec_kw = dict(kw, speculative=specdec.SpeculativeConfig(method="draft_model", draft_model="self",
                                                                     draft_quantization="int4",
                                                                     num_speculative_tokens=4))
            pair = {"plain bf16": llms["bf16"], "spec (self int4 draft)": specdec.LLM(path, **spec_kw)}
            for batch in batches:
                gen = torch.Generator().manual_seed(100 + batch)
                prompts = torch.randint(0, cfg["vocab_size"] - 8, (batch, prompt_len), generator=gen).tolist()
                runs = timed_runs(pair, prompts, params, reps)
                metrics = [o.metrics for o in runs["spec (self int4 draft)"]["outputs"]]
                drafted = sum(m["drafted"] for m in metrics)
                accepted = sum(m["accepted"] for m in metrics)
                same = sum(a.outputs[0].token_ids == b.outputs[0].token_ids for a, b in
                           zip(runs["spec (self int4 draft)"]["outputs"], runs["plain bf16"]["outputs"]))
                row = {"model": model, "batch": batch, "reps": reps, "plain_tok_s": runs["plain bf16"]["tok_s"],
                       "spec_tok_s": runs["spec (self int4 draft)"]["tok_s"],
                       "speedup": runs["spec (self int4 draft)"]["tok_s"] / runs["plain bf16"]["tok_s"],
                       "acceptance": accepted / drafted if drafted else None,
                       "greedy_identical": f"{same}/{batch}"}  # fmt: skip
                result["self_draft"].append(row)
                print(f"{model} self int4 draft, batch {batch}: {row['spec_tok_s']:.0f} vs {row['plain_tok_s']:.0f} "
                      f"tok/s, acceptance {row['acceptance']}", flush=True)
                save()
        del llms
        gc.collect()
        if cuda:
            torch.cuda.empty_cache()


def main(argv: list[str] | None = None) -> int:
    def extra(parser):
        parser.add_argument("--workdir", default=None, help="where the random checkpoints are written")

    args = parse_args(__doc__.splitlines()[0], argv, extra)
    cuda = torch.cuda.is_available() and not args.dry_run
    if not cuda:
        torch.set_num_threads(1)
    result: dict = {"device": torch.cuda.get_device_name() if cuda else "cpu", "copy": None, "kernel": [],
                    "plain": [], "self_draft": [],
                    "timer": "triton.testing.do_bench (return_mode='median')" if cuda else "perf_counter (median)",
                    "graph_timer": "CUDA graph replays over weight copies (bench.gpu_steps.graph_timing)" if cuda
                    else "skipped: no CUDA"}  # fmt: skip

    def save() -> None:
        write_json(args.out / "quant.json", result)

    result["copy"] = copy_bandwidth_gbps(1024 if cuda else 16, reps=20 if cuda else 3)
    save()
    kernel_rows(args, cuda, result["copy"]["copy_GBps"], result["kernel"], save)
    work = tempfile.mkdtemp(prefix="specdec_gpu_quant_", dir=args.workdir)
    engine_rows(args, cuda, work, result, save)
    if not cuda:
        print("STATUS: skipped: no CUDA (CPU reference paths, tiny shapes: not a GPU measurement)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
