"""Plain greedy decoding: our engine vs transformers' ``generate`` on the same weights, and the bandwidth ceiling.

    python -m bench.speed.plain_decode --model smollm2 [--batch 1 8] [--dtype float32] [--threads 1] [--max-tokens 64]

Both engines get the same token ids (prompts of ``bench/prompts/<class>``, cycled to the batch size, rendered
in the chat template and tokenised once), the same dtype, thread count and number of new tokens (ours with
``ignore_eos``, transformers with ``min_new_tokens``), and run A/B interleaved (the order alternates every
repetition); medians are reported. Per engine:

  decode tokens/s  B * (N - 1) / (time from the first token to the last): the steady decode rate, no prefill;
  e2e tokens/s     B * N / wall time of the generate call (prefill included).

The ceiling: a decode step must read every weight once (plus the KV cache of the batch), so with the copy
bandwidth measured in the same run, tokens/s <= B * bandwidth / (weight bytes + KV bytes). Each engine's decode
rate is reported as a fraction of it. ``--profile`` adds a torch profiler table of one run of each engine.
Results: ``bench/out/plain_decode_<model>_<dtype>_b<batches>_t<threads>.json`` (``--record``: in the tracked
``bench/results/``).
"""

from __future__ import annotations

import argparse
import gc
import sys
import time

import torch

import specdec
from bench.common import (
    add_record_flag,
    chat_token_ids,
    copy_bandwidth,
    kv_bytes_per_token,
    load_prompts,
    machine_info,
    median,
    print_table,
    resolve_model,
    set_threads,
    slug,
    timed,
    weight_bytes,
    write_json,
)


class _TokenClock:
    """A transformers stopping criterion that never stops: it timestamps every generated token."""

    def __init__(self):
        self.times: list[float] = []

    def __call__(self, input_ids, scores, **kwargs):
        self.times.append(time.perf_counter())
        return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)


class OursRunner:
    def __init__(self, llm: specdec.LLM):
        self.llm = llm

    def run(self, prompts: list[list[int]], max_tokens: int) -> dict:
        params = specdec.SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
        seconds, outs = timed(lambda: self.llm.generate(prompt_token_ids=prompts, sampling_params=params))
        # requests arrive within microseconds of each other: decode time = last finish - last first token
        first = max(o.metrics["time_to_first_token"] for o in outs)
        last = max(o.metrics["wall_time"] for o in outs)
        return {"seconds": seconds, "decode_seconds": last - first, "tokens": [o.outputs[0].token_ids for o in outs]}


class TransformersRunner:
    def __init__(self, model, pad_token_id: int):
        self.model = model
        self.pad_token_id = pad_token_id

    def run(self, prompts: list[list[int]], max_tokens: int) -> dict:
        from transformers import StoppingCriteriaList

        width = max(len(p) for p in prompts)  # left padding, as transformers' decoder-only generate expects
        input_ids = torch.tensor([[self.pad_token_id] * (width - len(p)) + p for p in prompts])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
        clock = _TokenClock()
        seconds, out = timed(lambda: self.model.generate(
            input_ids, attention_mask=mask, do_sample=False, max_new_tokens=max_tokens, min_new_tokens=max_tokens,
            pad_token_id=self.pad_token_id, stopping_criteria=StoppingCriteriaList([clock])))
        return {"seconds": seconds, "decode_seconds": clock.times[-1] - clock.times[0],
                "tokens": out[:, width:].tolist()}


def measure_batch(runners: dict, prompts: list[list[int]], max_tokens: int, reps: int) -> dict:
    """Interleaved repetitions of every runner on the same prompts; medians per runner."""
    for runner in runners.values():
        runner.run(prompts, min(4, max_tokens))  # warm-up
    samples = {name: [] for name in runners}
    tokens = {}
    for rep in range(reps):
        order = list(runners) if rep % 2 == 0 else list(reversed(runners))
        for name in order:
            result = runners[name].run(prompts, max_tokens)
            samples[name].append(result)
            tokens[name] = result["tokens"]
    batch = len(prompts)
    stats = {}
    for name, runs in samples.items():
        decode = median([r["decode_seconds"] for r in runs])
        total = median([r["seconds"] for r in runs])
        stats[name] = {
            "decode_tokens_per_s": batch * (max_tokens - 1) / decode,
            "e2e_tokens_per_s": batch * max_tokens / total,
            "ms_per_step": 1e3 * decode / (max_tokens - 1),
            "decode_seconds": [r["decode_seconds"] for r in runs],
            "seconds": [r["seconds"] for r in runs],
        }
    if "transformers" in tokens:
        stats["greedy_parity"] = parity(tokens["ours"], tokens["transformers"])
    return stats


def parity(ours: list[list[int]], theirs: list[list[int]]) -> dict:
    """How many sequences are token-identical, and where the first divergence is (informational: fp32 sums
    in a different order can flip a near-tie)."""
    prefixes = []
    for a, b in zip(ours, theirs):
        n = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
        prefixes.append(n)
    return {"identical_sequences": sum(a == b for a, b in zip(ours, theirs)), "sequences": len(ours),
            "first_divergence": min(prefixes)}


def profile_run(runner, prompts: list[list[int]], max_tokens: int, rows: int = 15) -> dict:
    """torch.profiler over one generate call of ``runner``: the top ops by self CPU time, and how much of the wall
    time the aten ops account for (the rest is Python: scheduling, metadata, per-sequence loops, sampling glue)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        seconds = runner.run(prompts, max_tokens)["seconds"]
    events = prof.key_averages()
    top = sorted(events, key=lambda e: e.self_cpu_time_total, reverse=True)[:rows]
    op_us = sum(e.self_cpu_time_total for e in events if e.key.startswith("aten::"))
    table = [{"op": e.key, "calls": e.count, "self_ms": e.self_cpu_time_total / 1e3,
              "share_of_wall": e.self_cpu_time_total / 1e6 / seconds} for e in top]
    return {"wall_seconds": seconds, "aten_self_seconds": op_us / 1e6, "aten_share_of_wall": op_us / 1e6 / seconds,
            "top_ops": table}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.speed.plain_decode", description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2", help="folder, or smollm2 | qwen-0.5b | qwen-1.5b")
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--prompt-class", default="prose", help="the bench/prompts class to draw prompts from")
    parser.add_argument("--no-transformers", action="store_true", help="time our engine only")
    parser.add_argument("--profile", action="store_true", help="also profile one run of each engine per batch size")
    add_record_flag(parser)
    args = parser.parse_args(argv)
    if args.max_tokens < 2:
        parser.error("--max-tokens must be >= 2 (the decode rate needs a token after the first)")

    set_threads(args.threads)
    meta = machine_info()
    path = resolve_model(args.model)
    bandwidth = copy_bandwidth()
    print(f"{meta['machine']}, torch {meta['torch']}, {torch.get_num_threads()} thread(s); "
          f"copy {bandwidth['copy_GBps']:.2f} GB/s, read {bandwidth['read_GBps']:.2f} GB/s", flush=True)

    texts = [p.text for p in load_prompts([args.prompt_class])[args.prompt_class]]
    # pool sized for the largest batch (plus slack): no KV memory beyond what the run needs
    llm = specdec.LLM(path, dtype=args.dtype, max_model_len=1024, num_kv_blocks=max(args.batch) * 64 + 64)
    ids = [chat_token_ids(llm.tokenizer, t) for t in texts]
    runners = {"ours": OursRunner(llm)}
    if not args.no_transformers:
        from transformers import AutoModelForCausalLM

        hf = AutoModelForCausalLM.from_pretrained(path, dtype=llm.engine.config.dtype).eval()
        pad = hf.generation_config.pad_token_id
        pad = pad if isinstance(pad, int) else llm.engine.config.eos_token_ids[0]
        runners["transformers"] = TransformersRunner(hf, pad)

    model, config, dtype = llm.engine.model, llm.engine.model_config, llm.engine.config.dtype
    weights = weight_bytes(model)
    results = []
    for batch in args.batch:
        prompts = [ids[i % len(ids)] for i in range(batch)]
        stats = measure_batch(runners, prompts, args.max_tokens, args.reps)
        mean_context = sum(len(p) for p in prompts) / batch + args.max_tokens / 2
        kv = int(batch * mean_context * kv_bytes_per_token(config, dtype))
        ceiling = batch * bandwidth["copy_GBps"] * 1e9 / (weights + kv)
        row = {"batch": batch, "prompt_tokens": [len(p) for p in prompts], "weight_bytes": weights,
               "kv_bytes_per_step": kv, "ceiling_tokens_per_s": ceiling, **stats}
        for name in runners:
            row[name]["fraction_of_ceiling"] = row[name]["decode_tokens_per_s"] / ceiling
        if "transformers" in runners:
            row["ours_over_transformers"] = (row["ours"]["decode_tokens_per_s"]
                                             / row["transformers"]["decode_tokens_per_s"])
        if args.profile:
            row["profile"] = {name: profile_run(runner, prompts, args.max_tokens) for name, runner in runners.items()}
        results.append(row)
        print(f"batch {batch} done", flush=True)
        gc.collect()

    header = ["batch", "engine", "decode tok/s", "e2e tok/s", "ms/step", "ceiling tok/s", "% ceiling"]
    table = []
    for row in results:
        for name in runners:
            s = row[name]
            table.append([row["batch"], name, s["decode_tokens_per_s"], s["e2e_tokens_per_s"], s["ms_per_step"],
                          row["ceiling_tokens_per_s"], 100 * s["fraction_of_ceiling"]])
    print(f"\n{path}: {weights / 1e6:.0f} MB of weights per step, {args.dtype}, {torch.get_num_threads()} thread(s), "
          f"{args.max_tokens} new tokens, median of {args.reps}")
    print_table(table, header)
    for row in results:
        if "greedy_parity" in row:
            p = row["greedy_parity"]
            print(f"batch {row['batch']}: ours / transformers decode = {row['ours_over_transformers']:.2f}x; greedy "
                  f"tokens identical in {p['identical_sequences']}/{p['sequences']} sequences")
        for engine, prof in row.get("profile", {}).items():
            print(f"batch {row['batch']} {engine} profile: {prof['wall_seconds']:.2f} s, aten ops "
                  f"{100 * prof['aten_share_of_wall']:.0f}% of it; top: "
                  + ", ".join(f"{op['op']} {100 * op['share_of_wall']:.0f}%" for op in prof["top_ops"][:6]))

    name = f"plain_decode_{slug(args.model if '/' not in args.model else path.rstrip('/').split('/')[-1])}"
    out = write_json(f"{name}_{args.dtype}_b{'-'.join(map(str, args.batch))}_t{args.threads}", {
        "meta": {**meta, "model": path, "dtype": args.dtype, "threads": args.threads, "max_tokens": args.max_tokens,
                 "reps": args.reps, "prompt_class": args.prompt_class, "bandwidth": bandwidth,
                 "command": "python -m bench.speed.plain_decode " + " ".join(sys.argv[1:] if argv is None else argv)},
        "results": results,
    }, record=args.record)
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
