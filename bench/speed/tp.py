"""Tensor parallelism on this CPU: TP=1 against TP=2, plain and speculative, the collectives' cost, and each
rank's memory while loading (issue 20).

    python -m bench.speed.tp [--target qwen-1.5b --draft qwen-0.5b --k 4] [--dtype bfloat16]
                       [--prompts code,prose] [--prompts-per-class 1] [--max-tokens 40] [--reps 2]
    python -m bench.speed.tp --collectives-only      # the gloo collectives alone (2 ranks x 1 thread)
    python -m bench.speed.tp --memory-only           # peak RSS per rank while loading the target, TP=1 and TP=2
    python -m bench.speed.tp --quantization int8 --draft-quantization int4   # quantised target / draft, every config

Decode configurations: ``plain`` and ``spec`` (the draft model, sharded over the same ranks, fixed k) crossed with
``tp1x1`` (1 rank x 1 thread), ``tp1x2`` (1 rank x 2 threads) and ``tp2x1`` (2 ranks x 1 thread each: rank 0 and
its spawned worker). Each run of a configuration is its own process (a fresh engine, one copy of the weights in
memory) that loads the models, warms up with one short generation, then generates every prompt (chat template,
batch 1, greedy, ``ignore_eos``) and reports per prompt: wall seconds, CPU seconds of every rank (rank 0's
``process_time`` + each worker's utime + stime from ``/proc/<pid>/stat``), engine steps and, under TP=2, how
many all-reduces / broadcasts / gathers rank 0 made and the seconds it spent inside them (which includes waiting
for the slower rank, so it is an upper bound on their cost). Repetitions interleave the configurations in an
order that rotates by repetition; reported: tokens/s by wall clock and by CPU time (median over repetitions),
tokens per step, collectives per step, and whether every configuration gave the same tokens.

``--collectives-only`` (also part of a full run) times the collectives alone the way the engine makes them
(``TPGroup`` over a ``ProcessGroupGloo``, 2 ranks x 1 thread, loopback): the all-reduce of ``[rows, hidden]`` in
the model's dtype, the payload broadcast (int64) and the fp32 logits gather of ``[rows, V / 2]``; median of
``--collective-reps``. Multiplied by the counts per step it gives the collectives' share of a step.

``--memory-only`` (also part of a full run) loads the target alone with TP=1 and TP=2 in fresh processes and
reports each rank's peak RSS (``VmHWM``), its RSS before loading (torch and specdec imported: the runtime), the
bytes of its parameters and packed copies (a quantised linear's: what its CPU path holds), and the share it should
hold in ``--dtype`` (its slices plus the replicated norms). ``--quantization`` / ``--draft-quantization`` quantise
the target / the draft in every run (memory runs included; the results file's name says so).

The machine is shared (2 cores, other jobs): the load average is recorded at start and after every run.
Results: ``bench/out/tp_<target>_<draft>_k<K>.json`` (``--record``: ``bench/results/``).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
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
    model_sizes,
    print_table,
    resolve_model,
    set_threads,
    slug,
    write_json,
)

CONFIGS = [f"{d}/tp{n}x{t}" for d in ("plain", "spec") for n, t in ((1, 1), (1, 2), (2, 1))]
CLK_TCK = os.sysconf("SC_CLK_TCK")


def parse_config(name: str) -> tuple[str, int, int]:
    decode, tp = name.split("/")
    ranks, threads = tp.removeprefix("tp").split("x")
    return decode, int(ranks), int(threads)


# --- per-process helpers -----------------------------------------------------------------------------------
def proc_cpu_seconds(pid: int) -> float:
    """utime + stime of process ``pid`` (all its threads), in seconds."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / CLK_TCK


def proc_status_kb(pid: int | str, key: str) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1])
    raise KeyError(key)


class CollectiveCounter:
    """Wraps rank 0's ``TPGroup`` methods: how many of each collective it made and the seconds inside them, over
    every group given (the compute group and the command channel's control group)."""

    KINDS = {"all_reduce": "all_reduce", "broadcast": "broadcast", "gather_last_dim": "gather"}

    def __init__(self, *groups):
        self.counts = dict.fromkeys(self.KINDS.values(), 0)
        self.seconds = dict.fromkeys(self.KINDS.values(), 0.0)
        for group in groups:
            for method, kind in self.KINDS.items():
                setattr(group, method, self._wrap(getattr(group, method), kind))

    def _wrap(self, fn, kind):
        def wrapped(*args, **kwargs):
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds[kind] += time.perf_counter() - start
                self.counts[kind] += 1
        return wrapped

    def snapshot(self) -> tuple[dict, dict]:
        return dict(self.counts), dict(self.seconds)


def run_one(args) -> dict:
    """In this process: build configuration ``args.one``, warm it up, generate every prompt (batch 1)."""
    decode, ranks, threads = parse_config(args.one)
    set_threads(threads)
    target = resolve_model(args.target)
    spec = None
    if decode == "spec":
        spec = specdec.SpeculativeConfig(draft_model=resolve_model(args.draft), num_speculative_tokens=args.k,
                                         draft_quantization=args.draft_quantization)
    llm = specdec.LLM(target, dtype=args.dtype, max_model_len=args.max_model_len, num_kv_blocks=args.num_kv_blocks,
                      speculative=spec, tensor_parallel_size=ranks, quantization=args.quantization)
    engine = llm.engine
    steps = [0]
    step = engine.step

    def counted_step():
        steps[0] += 1
        return step()

    engine.step = counted_step
    workers = engine.workers
    counter = CollectiveCounter(workers.group, workers.channel.control) if workers is not None else None
    pids = [p.pid for p in workers.procs] if workers is not None else []
    prompts = [(p.cls, p.name, chat_token_ids(engine.tokenizer, p.text))
               for ps in load_prompts(args.prompts.split(","), args.prompts_per_class).values() for p in ps]
    params = specdec.SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
    llm.generate(prompt_token_ids=[prompts[0][2]], sampling_params=specdec.SamplingParams(temperature=0, max_tokens=8))
    out = []
    for cls, name, ids in prompts:
        steps[0] = 0
        counts0, secs0 = counter.snapshot() if counter else ({}, {})
        cpu0 = time.process_time() + sum(proc_cpu_seconds(p) for p in pids)
        wall0 = time.perf_counter()
        outs = llm.generate(prompt_token_ids=[ids], sampling_params=params)
        wall = time.perf_counter() - wall0
        cpu = time.process_time() + sum(proc_cpu_seconds(p) for p in pids) - cpu0
        row = {"class": cls, "prompt": name, "prompt_tokens": len(ids), "seconds": wall, "cpu_seconds": cpu,
               "steps": steps[0], "tokens": outs[0].outputs[0].token_ids, "error": outs[0].error}
        if counter:
            counts1, secs1 = counter.snapshot()
            row["collectives"] = {k: counts1[k] - counts0[k] for k in counts1}
            row["collective_seconds"] = {k: secs1[k] - secs0[k] for k in secs1}
        out.append(row)
    llm.shutdown()
    return {"runs": out, "load_average_after": os.getloadavg()}


# --- collectives alone -------------------------------------------------------------------------------------
def collective_cases(hidden: int, vocab: int, dtype: torch.dtype,
                     payloads: list[int]) -> list[tuple[str, tuple, torch.dtype]]:
    half = -(-vocab // 2)
    cases = [(f"all_reduce [{r}, {hidden}] {str(dtype).removeprefix('torch.')}", (r, hidden), dtype) for r in (1, 5)]
    cases += [(f"broadcast int64 [{n}]", (n,), torch.int64) for n in payloads]
    cases += [(f"gather fp32 [{r}, {half}] -> [{r}, {2 * half}]", (r, half), torch.float32) for r in (1, 5)]
    return cases


def _collective_loop(group, cases, reps: int) -> list[float]:
    medians = []
    for name, shape, dtype in cases:
        x = torch.ones(shape, dtype=dtype)
        op = (group.all_reduce if name.startswith("all_reduce") else group.broadcast if name.startswith("broadcast")
              else group.gather_last_dim)
        for _ in range(5):
            op(x)
        samples = []
        for _ in range(reps):
            start = time.perf_counter()
            op(x)
            samples.append(time.perf_counter() - start)
        medians.append(median(samples))
    return medians


def _collective_worker(rank: int, port: int, cases, reps: int) -> None:
    import datetime

    import torch.distributed as dist

    from specdec.distributed.comm import TPGroup

    torch.set_num_threads(1)
    group = TPGroup(rank, 2, torch.device("cpu"), 60.0)
    group.connect(dist.TCPStore("127.0.0.1", port, 2, False, timeout=datetime.timedelta(seconds=60)))
    _collective_loop(group, cases, reps)
    group.abort()


def measure_collectives(args) -> dict:
    """Rank 0 here, rank 1 spawned (1 thread each): each collective's median seconds on rank 0."""
    import datetime

    import torch.distributed as dist
    import torch.multiprocessing as mp

    from specdec.distributed.comm import TPGroup
    from specdec.model.config import ModelConfig, resolve_dtype

    config = ModelConfig.from_json(resolve_model(args.target))
    draft = ModelConfig.from_json(resolve_model(args.draft))
    dtype = resolve_dtype(args.dtype)
    cases = collective_cases(config.hidden_size, config.vocab_size, dtype, [256, 1024])
    cases += [c for c in collective_cases(draft.hidden_size, draft.vocab_size, dtype, [])
              if c[0].startswith("all_reduce")]
    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", 0, 2, True, timeout=datetime.timedelta(seconds=60), wait_for_workers=False)
    proc = mp.get_context("spawn").Process(target=_collective_worker, args=(1, store.port, cases, args.collective_reps))
    proc.start()
    group = TPGroup(0, 2, torch.device("cpu"), 60.0)
    group.connect(store)
    medians = _collective_loop(group, cases, args.collective_reps)
    proc.join(60)
    group.abort()
    return {name: {"shape": list(shape), "median_ms": 1e3 * m} for (name, shape, _), m in zip(cases, medians)}


# --- memory while loading ----------------------------------------------------------------------------------
def memory_one(args) -> dict:
    """In this process: load the target with ``args.memory_one`` ranks (no draft, 1 thread); every rank's peak RSS,
    rank 0's RSS before loading and its parameter bytes, and the share a rank should hold."""
    from specdec.checkpoint.loader import iter_weight_entries
    from specdec.distributed.sharding import ShardLayout

    ranks = args.memory_one
    set_threads(1)
    target = resolve_model(args.target)
    before_kb = proc_status_kb("self", "VmRSS")
    llm = specdec.LLM(target, dtype=args.dtype, max_model_len=args.max_model_len, num_kv_blocks=args.num_kv_blocks,
                      tensor_parallel_size=ranks, prepack_weights=args.memory_prepack, quantization=args.quantization)
    engine = llm.engine
    model = engine.workers.shards[0][0].local if engine.workers is not None else engine.model
    pool = engine.pool
    held = 0
    for m in model.modules():
        if hasattr(m, "held_bytes"):  # a QuantizedLinear: its CPU path's copies (or quantised tensors) and bias
            held += m.held_bytes()
            continue
        for p in m.parameters(recurse=False):
            if p.device.type != "meta":
                held += p.numel() * p.element_size()
        packed = getattr(m, "packed_copy", None)
        if packed is not None:
            held += packed.numel() * packed.element_size()  # NOTE: the packed layout may pad; numel is a lower bound
    pool_bytes = sum(t.numel() * t.element_size() for t in pool.tensors)
    element = torch.empty((), dtype=engine.config.dtype).element_size()
    config = engine.config.model_config
    shares = []
    for rank in range(ranks):
        layout = ShardLayout.of(config, rank, ranks)
        total = replicated = 0
        seen = set()
        for name, entry in iter_weight_entries(target):
            if name in seen:
                continue
            seen.add(name)
            part = layout.slice_of(name, entry)
            n = 1
            for d in part.shape:
                n *= d
            total += n * element
            if part is entry and ranks > 1:
                replicated += n * element
        shares.append({"rank": rank, "checkpoint_share_bytes": total, "replicated_bytes": replicated})
    ranks_out = [{"rank": 0, "pid": os.getpid(), "VmHWM_kB": proc_status_kb("self", "VmHWM"),
                  "VmRSS_kB": proc_status_kb("self", "VmRSS"), "RssAnon_kB": proc_status_kb("self", "RssAnon")}]
    for rank, proc in enumerate(engine.workers.procs if engine.workers is not None else [], start=1):
        ranks_out.append({"rank": rank, "pid": proc.pid, "VmHWM_kB": proc_status_kb(proc.pid, "VmHWM"),
                          "VmRSS_kB": proc_status_kb(proc.pid, "VmRSS"),
                          "RssAnon_kB": proc_status_kb(proc.pid, "RssAnon")})
    llm.shutdown()
    return {"ranks": ranks, "rss_before_load_kB": before_kb, "rank0_held_bytes": held,
            "pool_bytes_per_rank": pool_bytes, "shares": shares, "per_rank": ranks_out,
            "prepack_weights": args.memory_prepack, "quantization": args.quantization}


# --- the parent: interleaved runs --------------------------------------------------------------------------
def child(argv: list[str], extra: list[str], tmp: str) -> dict:
    out = Path(tmp) / "one.json"
    cmd = [sys.executable, "-m", "bench.speed.tp", *argv, *extra, "--one-out", str(out)]
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, cwd=Path(__file__).resolve().parents[2])
    return json.loads(out.read_text())


def measure(args, argv: list[str]) -> dict:
    names = args.configs.split(",") if args.configs else CONFIGS
    runs = {n: [] for n in names}
    with tempfile.TemporaryDirectory() as tmp:
        for rep in range(args.reps):
            order = names[rep % len(names):] + names[: rep % len(names)]
            for name in order:
                runs[name].append(child(argv, ["--one", name], tmp))
                print(f"repetition {rep + 1}/{args.reps}: {name} done (load {os.getloadavg()[0]:.2f})", flush=True)
    return runs


def summarize(runs: dict, collectives: dict | None) -> dict:
    out = {}
    reference = None
    for name, reps in runs.items():
        first = reps[0]["runs"]
        tokens = sum(len(r["tokens"]) for r in first)
        walls = [sum(r["seconds"] for r in rep["runs"]) for rep in reps]
        cpus = [sum(r["cpu_seconds"] for r in rep["runs"]) for rep in reps]
        steps = sum(r["steps"] for r in first)
        row = {"tok_s_wall": tokens / median(walls), "tok_s_cpu": tokens / median(cpus),
               "cpu_per_wall": median(cpus) / median(walls), "tokens_per_step": tokens / steps, "steps": steps,
               "tokens": tokens, "wall_seconds": walls, "cpu_seconds": cpus,
               "load_after": [rep["load_average_after"][0] for rep in reps],
               "same_tokens_every_rep": all([r["tokens"] for r in rep["runs"]] == [r["tokens"] for r in first]
                                            for rep in reps)}
        if "collectives" in first[0]:
            counts = {k: sum(r["collectives"][k] for r in first) for k in first[0]["collectives"]}
            secs = [sum(sum(r["collective_seconds"].values()) for r in rep["runs"]) for rep in reps]
            row["collectives_per_step"] = {k: v / steps for k, v in counts.items()}
            row["rank0_seconds_in_collectives"] = secs
            row["share_of_wall_in_collectives"] = median(secs) / median(walls)
        decode = name.split("/")[0]
        ref = [r["tokens"] for r in first]
        if decode == "plain" and name.endswith("tp1x1"):
            reference = ref
        row["_tokens"] = ref
        out[name] = row
    for row in out.values():
        row["same_tokens_as_plain_tp1x1"] = None if reference is None else row["_tokens"] == reference
        del row["_tokens"]
    return out


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", default="qwen-1.5b")
    parser.add_argument("--draft", default="qwen-0.5b")
    parser.add_argument("--k", type=int, default=4)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--prompts", default="code,prose")
    parser.add_argument("--prompts-per-class", type=int, default=1)
    parser.add_argument("--max-tokens", type=int, default=40)
    parser.add_argument("--max-model-len", type=int, default=1024)
    parser.add_argument("--num-kv-blocks", type=int, default=80)
    parser.add_argument("--reps", type=int, default=2)
    parser.add_argument("--configs", default=None, help=f"comma-separated subset of {CONFIGS}")
    parser.add_argument("--collective-reps", type=int, default=200)
    parser.add_argument("--collectives-only", action="store_true")
    parser.add_argument("--memory-only", action="store_true")
    parser.add_argument("--memory-prepack", type=lambda s: {"none": None, "true": True, "false": False}[s.lower()],
                        default=None, help="prepack_weights for the memory runs: none (default), true, false")
    parser.add_argument("--quantization", choices=("int8", "int4"), default=None,
                        help="the target's LLM(quantization=) in every configuration (default: none)")
    parser.add_argument("--draft-quantization", choices=("int8", "int4"), default=None,
                        help="the draft's SpeculativeConfig(draft_quantization=) (default: none)")
    parser.add_argument("--one", help=argparse.SUPPRESS)
    parser.add_argument("--memory-one", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--one-out", help=argparse.SUPPRESS)
    add_record_flag(parser)
    args = parser.parse_args(argv)
    if args.one or args.memory_one:
        result = run_one(args) if args.one else memory_one(args)
        Path(args.one_out).write_text(json.dumps(result))
        return
    meta = {**machine_info(), "argv": argv, "target_sizes": model_sizes(resolve_model(args.target)),
            "draft_sizes": model_sizes(resolve_model(args.draft))}
    payload: dict = {"meta": meta}
    child_argv = [a for a in argv if a not in ("--collectives-only", "--memory-only", "--record")]
    if not args.memory_only:
        payload["collectives"] = measure_collectives(args)
        print_table([[k, v["median_ms"]] for k, v in payload["collectives"].items()],
                    ["collective (2 ranks x 1 thread)", "median ms"])
    if not (args.collectives_only or args.memory_only):
        payload["runs"] = measure(args, child_argv)
        payload["summary"] = summarize(payload["runs"], payload.get("collectives"))
        rows = [[n, s["tok_s_wall"], s["tok_s_cpu"], s["cpu_per_wall"], s["tokens_per_step"],
                 *((s["collectives_per_step"][k] for k in ("all_reduce", "broadcast", "gather"))
                   if "collectives_per_step" in s else ("-", "-", "-")),
                 s.get("share_of_wall_in_collectives"), s["same_tokens_as_plain_tp1x1"]]
                for n, s in payload["summary"].items()]
        print_table(rows, ["config", "tok/s wall", "tok/s cpu", "cpu/wall", "tok/step", "allreduce/step",
                           "bcast/step", "gather/step", "rank0 in coll.", "= plain tp1x1"])
    if not args.collectives_only and (args.memory_only or not args.configs):
        with tempfile.TemporaryDirectory() as tmp:
            payload["memory"] = [child(child_argv, ["--memory-one", str(n)], tmp) for n in (1, 2)]
        rows = [[m["ranks"], r["rank"], r["VmHWM_kB"] / 2**20, r["RssAnon_kB"] / 2**20, m["rss_before_load_kB"] / 2**20,
                 m["shares"][r["rank"]]["checkpoint_share_bytes"] / 2**30, m["rank0_held_bytes"] / 2**30]
                for m in payload["memory"] for r in m["per_rank"]]
        print_table(rows, ["TP", "rank", "peak RSS GiB", "RssAnon now GiB", "rank0 RSS before load GiB",
                           f"share GiB ({args.dtype})", "rank 0 holds GiB"])
    meta["load_average_at_end"] = os.getloadavg()
    suffix = "collectives" if args.collectives_only else "memory" if args.memory_only else f"k{args.k}"
    if args.memory_only and args.memory_prepack is not None:
        suffix += f"_prepack-{str(args.memory_prepack).lower()}"
    suffix += "".join(f"_{what}-{q}" for what, q in (("q", args.quantization), ("dq", args.draft_quantization)) if q)
    path = write_json(f"tp_{slug(args.target)}_{slug(args.draft)}_{suffix}", payload, args.record)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
