"""Step e2e: plain vs speculative decoding end to end on random-weight models (e2e.json, profile.txt).

Pairs (bf16, greedy, k = 4, ``ignore_eos``, random prompt ids):
  random   target Llama-3.2-3B-shaped, draft Llama-3.2-1B-shaped, independent random weights: the two do not
           agree (acceptance ~0), so this pair measures costs - c, v(k), the engine's overheads - not a speedup;
  damped   target Llama-3.2-1B-shaped whose layers >= 2 write into the residual stream scaled by 0.1, draft its
           first 2 layers (same weights): a draft of known (measured) and substantial acceptance.
Per pair and batch size (1, 8, 64): ``bench.e2e.phase_a`` (plain and speculative engines sharing the target's
weights, interleaved, medians; tokens/s = generated tokens / wall time of ``generate``, prefill included),
the acceptance, alpha and tau, and ``bench.e2e.measure_costs``: c = draft decode / target decode and v(j) =
target forward of j + 1 tokens per request / of 1 token, on the engine's own forward (CUDA-synchronised).
Then one speculative round at batch 8 of the random pair under ``torch.profiler`` (top ops in profile.txt;
counts of cudaMemcpy*, cudaStreamSynchronize and aten::_local_scalar_dense events, i.e. host syncs), and a
small fp32 pair: are greedy speculative tokens identical to plain greedy ones on this device?
Dry run: the same on CPU with tiny models (hidden 64, 2 layers, vocab 512), batch 1 and 2, 8 new tokens.
"""

from __future__ import annotations

import gc
import shutil
import sys
import tempfile
import time

import torch

import specdec
from bench.e2e import Ours, measure_costs, phase_a, reuse_target_weights, warm_up
from bench.gpu_steps.common import cuda_synced_timing, out_of_time, parse_args, sync, write_json
from bench.gpu_steps.models import LLAMA_1B, LLAMA_3B, TINY, write_random_llama

K = 4
SYNC_EVENTS = ("cudaMemcpy", "cudaStreamSynchronize", "cudaDeviceSynchronize", "aten::_local_scalar_dense",
               "aten::item")  # fmt: skip


def plan(dry: bool) -> dict:
    if dry:
        small = dict(TINY, num_layers=2)
        return {"batches": [1, 2], "prompt_len": 16, "max_tokens": 8, "reps": 1, "profile_batch": 2,
                "pairs": {"random": ({**small, "seed": 1}, {**small, "seed": 2}),
                          "damped": ({**small, "seed": 3, "damp_from": 1, "damp": 0.1},
                                     {**small, "seed": 3, "truncate_to": 1})},
                "fp32": ({**small, "seed": 5, "damp_from": 1, "damp": 0.1}, {**small, "seed": 5, "truncate_to": 1})}
    fp32 = dict(hidden_size=256, num_layers=4, num_heads=4, num_kv_heads=2, intermediate_size=1024, vocab_size=4096)
    return {"batches": [1, 8, 64], "prompt_len": 128, "max_tokens": 64, "reps": 2, "profile_batch": 8,
            "pairs": {"random": ({**LLAMA_3B, "seed": 1}, {**LLAMA_1B, "seed": 2}),
                      "damped": ({**LLAMA_1B, "seed": 3, "damp_from": 2, "damp": 0.1},
                                 {**LLAMA_1B, "seed": 3, "truncate_to": 2})},
            "fp32": ({**fp32, "seed": 5, "damp_from": 2, "damp": 0.1}, {**fp32, "seed": 5, "truncate_to": 2})}


def write_pair(work: str, name: str, target_kw: dict, draft_kw: dict, dtype: torch.dtype) -> tuple[str, str, float]:
    start = time.time()
    target = write_random_llama(f"{work}/{name}_target", dtype=dtype, **target_kw)
    draft = write_random_llama(f"{work}/{name}_draft", dtype=dtype, **draft_kw)
    return target, draft, time.time() - start


def engine_kwargs(dtype: str, max_model_len: int, max_batch: int) -> dict:
    return {"dtype": dtype, "max_model_len": max_model_len, "seed": 0, "max_num_seqs": max(64, max_batch),
            "num_kv_blocks": max_batch * (max_model_len // 16 + 1) + 2}  # fmt: skip


def engines(target: str, draft: str, dtype: str, max_model_len: int, max_batch: int):
    kwargs = engine_kwargs(dtype, max_model_len, max_batch)
    plain = specdec.LLM(target, **kwargs)
    with reuse_target_weights(plain):  # one copy of the target's weights for both engines
        spec = specdec.LLM(target, speculative=specdec.SpeculativeConfig(
            method="draft_model", draft_model=draft, num_speculative_tokens=K), **kwargs)  # fmt: skip
    return plain, spec


def draft_model_of(spec: specdec.LLM):
    drafter = spec.engine.speculative.proposer
    return drafter.runner.model, drafter.config


def profile_round(spec: specdec.LLM, prompts: list[list[int]], max_tokens: int) -> tuple[dict, str]:
    """One speculative round (engine.step after every request has verified once) under torch.profiler."""
    from torch.profiler import ProfilerActivity, profile

    engine = spec.engine
    params = specdec.SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    ids = [engine.add_request(prompt_token_ids=p, params=params) for p in prompts]
    rounds: dict[str, int] = {}
    for _ in range(50):  # prefill (maybe chunked), then rounds until every request has verified a draft
        for out in engine.step():
            rounds[out.request_id] = out.metrics["num_rounds"]
        if len(rounds) == len(ids) and min(rounds.values()) > 0:
            break
    cuda = torch.cuda.is_available()
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    sync()
    with profile(activities=activities) as prof:
        engine.step()
        sync()
    for request_id in ids:
        engine.abort(request_id)
    while engine.has_unfinished_requests():
        engine.step()
    averages = prof.key_averages()
    counts = {name: sum(e.count for e in averages if e.key.startswith(name)) for name in SYNC_EVENTS}
    sort = "self_cuda_time_total" if cuda else "self_cpu_time_total"
    table = averages.table(sort_by=sort, row_limit=40, max_name_column_width=60)
    return counts, table


def graphs_vs_eager(plain: specdec.LLM, target: str, prompts: list[list[int]], params, p: dict,
                    max_model_len: int) -> dict:
    """Plain decoding as the engine runs it (CUDA graphs on CUDA) against ``enforce_eager=True``, interleaved, at
    the batch sizes up to 8: what the graphs buy, and whether they were really replayed (no silent fallback)."""
    with reuse_target_weights(plain):
        eager = specdec.LLM(target, enforce_eager=True, **engine_kwargs("bfloat16", max_model_len, max(p["batches"])))
    out = {}
    for batch in [b for b in p["batches"] if b <= 8]:
        warm_up([eager, plain], prompts[:batch])
        row = phase_a(Ours(eager, params), Ours(plain, params), {"ids": prompts[:batch]}, batch, p["reps"])["ids"]
        out[str(batch)] = {"eager_tokens_per_s": row["plain_tokens_per_s"], "graphs_tokens_per_s":
                           row["spec_tokens_per_s"], "speedup": row["speedup"],
                           "identical_tokens": row["identical_tokens"]}  # fmt: skip
    static = plain.engine.runner.static
    out["static_mode"] = static.mode if static is not None else None
    out["replays"] = static.num_replays if static is not None else 0
    out["fallbacks"] = static.num_fallbacks if static is not None else 0
    del eager
    return out


def run_pair(args, name: str, target: str, draft: str, p: dict, result: dict, save) -> None:
    vocab = p["pairs"][name][0]["vocab_size"]
    gen = torch.Generator().manual_seed(7)
    max_batch = max(p["batches"])
    prompts = torch.randint(300, vocab, (max_batch, p["prompt_len"]), generator=gen).tolist()
    max_model_len = -(-(p["prompt_len"] + p["max_tokens"] + K + 2) // 16) * 16
    start = time.time()
    plain, spec = engines(target, draft, "bfloat16", max_model_len, max_batch)
    entry = result["pairs"][name] = {"load_s": time.time() - start, "batches": {}}
    params = specdec.SamplingParams(temperature=0, max_tokens=p["max_tokens"], ignore_eos=True)
    target_model, config = spec.engine.model, spec.engine.model_config
    draft_model, draft_config = draft_model_of(spec)
    context = p["prompt_len"] + p["max_tokens"] // 2
    with cuda_synced_timing():
        for batch in p["batches"]:
            if out_of_time(args, 30 if args.dry_run else 60):
                entry["stopped_early"] = f"before batch {batch}"
                break
            warm_up([plain, spec], prompts[:batch])  # compiles every kernel shape this batch size needs
            rows = phase_a(Ours(plain, params), Ours(spec, params), {"ids": prompts[:batch]}, batch, p["reps"])
            row = rows["ids"]
            row.pop("runs", None)
            row["costs"] = measure_costs(target_model, draft_model, config, draft_config, batch, context, K)
            entry["batches"][str(batch)] = row
            save()
        if name == "random" and not out_of_time(args, 30 if args.dry_run else 60):
            entry["graphs_vs_eager"] = graphs_vs_eager(plain, target, prompts, params, p, max_model_len)
            save()
        if name == "random" and not out_of_time(args, 20):
            counts, table = profile_round(spec, prompts[: p["profile_batch"]], p["max_tokens"])
            result["profile"] = {"pair": name, "batch": p["profile_batch"], "event_counts": counts}
            header = (f"torch.profiler, one speculative round (engine.step) of the {name} pair at batch "
                      f"{p['profile_batch']}, k={K}\nevent counts: {counts}\n\n")  # fmt: skip
            (args.out / "profile.txt").write_text(header + table + "\n")
            save()
    del plain, spec, target_model, draft_model
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def fp32_identity(args, work: str, p: dict, result: dict) -> None:
    """Greedy speculative tokens vs plain greedy tokens, fp32, batch 4: identical on this device?"""
    target, draft, _ = write_pair(work, "fp32", *p["fp32"], torch.float32)
    vocab = p["fp32"][0]["vocab_size"]
    prompts = torch.randint(300, vocab, (4, 24), generator=torch.Generator().manual_seed(3)).tolist()
    plain, spec = engines(target, draft, "float32", 128, 4)
    params = specdec.SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    a = plain.generate(prompt_token_ids=prompts, sampling_params=params)
    b = spec.generate(prompt_token_ids=prompts, sampling_params=params)
    same = sum(x.outputs[0].token_ids == y.outputs[0].token_ids for x, y in zip(a, b))
    accepted = sum(o.metrics["accepted"] for o in b) / max(1, sum(o.metrics["drafted"] for o in b))
    result["fp32_greedy_identity"] = {"identical": same, "requests": len(prompts), "acceptance_rate": accepted,
                                      "tokens_per_request": 32}  # fmt: skip
    print(f"fp32 greedy identity: {same}/{len(prompts)} identical (acceptance {accepted:.2f})", flush=True)


def main(argv: list[str] | None = None) -> int:
    def extra(parser):
        parser.add_argument("--workdir", default=None, help="where the random models go (default: a temp dir)")

    args = parse_args(__doc__.splitlines()[0], argv, extra)
    cuda = torch.cuda.is_available() and not args.dry_run
    if not cuda:
        torch.set_num_threads(1)
    p = plan(args.dry_run)
    work = tempfile.mkdtemp(prefix="specdec_gpu_models_", dir=args.workdir)
    result: dict = {"device": torch.cuda.get_device_name() if cuda else "cpu", "dtype": "bfloat16", "k": K,
                    "method": "draft_model", "temperature": 0, "prompt_len": p["prompt_len"],
                    "max_tokens": p["max_tokens"], "reps": p["reps"], "batches": p["batches"],
                    "models": {n: {"target": t, "draft": d} for n, (t, d) in p["pairs"].items()},
                    "pairs": {}}  # fmt: skip

    def save() -> None:
        write_json(args.out / "e2e.json", result)

    try:
        for name, (target_kw, draft_kw) in p["pairs"].items():
            if out_of_time(args, 60 if not args.dry_run else 10):
                break
            target, draft, seconds = write_pair(work, name, target_kw, draft_kw, torch.bfloat16)
            print(f"{name}: wrote random models in {seconds:.0f} s", flush=True)
            result.setdefault("write_models_s", {})[name] = seconds
            run_pair(args, name, target, draft, p, result, save)
            shutil.rmtree(f"{work}/{name}_target", ignore_errors=True)
            shutil.rmtree(f"{work}/{name}_draft", ignore_errors=True)
        if not out_of_time(args, 20):
            fp32_identity(args, work, p, result)
    finally:
        save()
        shutil.rmtree(work, ignore_errors=True)
    for name, entry in result["pairs"].items():
        for batch, row in entry["batches"].items():
            print(f"{name} batch {batch}: plain {row['plain_tokens_per_s']:.1f} tok/s, spec "
                  f"{row['spec_tokens_per_s']:.1f} tok/s ({row['speedup']:.2f}x), acceptance {row['acceptance_rate']}, "
                  f"tau {row['tau']}, c {row['costs']['c']:.3f}, v(k) {row['costs']['v_k']:.3f}")  # fmt: skip
    if not cuda:
        print("STATUS: ok (CPU, tiny models: not a GPU measurement)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
