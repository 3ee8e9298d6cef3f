"""Step real: SmolLM2-135M's real weights on the GPU - plain decoding vs prompt lookup vs n-gram drafting (real.json).

Opt-in: ``python -m bench.gpu --only real`` (its weights must be carried first: ``bench/gpu_weights.py`` says how).
The model is SmolLM2-135M-Instruct from its GGUF, reassembled in ``.gpu_weights/`` by ``bench.gpu_weights join``
(joined here if the chunks are there and it is not yet; its sha256 must be MODELS.md's) or named by ``--gguf``,
loaded in bf16 (the engine's default static forward: CUDA graphs on CUDA), prefix caching off, chains of k = 4,
``ignore_eos`` and every request of every run checked (``e2e.check_outputs``). No GGUF in ``.gpu_weights/`` (no
manifest): the step is skipped and says so; a manifest with a missing or corrupt chunk fails it.

Prompts: the first file of each class (code, json, copy, prose) and the long-context summarisation prompt
(``bench/prompts/long``: a ~2,000-word report), in the chat template; a batch of B cycles the class's files. Per
batch size (1 and 8; ``--batches 1 8 32``, or ``BENCH_GPU_REAL_BATCHES="1 8 32"`` through ``bench.gpu``, adds 32),
temperature (0 and 0.8) and class: a warm-up run of each engine on exactly the timed prompts (every CUDA-graph bucket
captured before timing), then 3 interleaved runs (``bench.speed.e2e.interleave``) of plain, ``prompt_lookup`` and
``ngram_table``; tok/s from the median run (an odd count: one run's own time). From the requests' metrics
(``bench.speed.e2e.aggregate_metrics``): acceptance, alpha, tau (tokens per round), f (the share of decode steps that
verified a draft: a model-free drafter with no match takes a plain step) and the mean draft length. Costs per batch
and class, through a speculative engine's own target runner (``e2e.runner_forward_seconds``: CUDA graphs as the
engine replays them) at the class's context: the decode time and v(j) = forward of j + 1 tokens / of 1. c for these
model-free drafters is their measured drafting overhead: the host time of the proposer's ``propose`` per call
(one call per decode step, the whole batch), timed during the timed runs, over k target decodes - so k c is a
step's drafting time in target-decode units. Beside each measured speedup, Theorem 3.8 with v(k)
(``bench.speed.e2e.improvement``, which assumes every step drafts k) and the round-mix prediction
(``bench.speed.e2e.round_mix``: the measured f, tau and draft length; the one that fits a model-free drafter).

Dry run: a tiny random model (``models.TINY``) in place of SmolLM2 (no GGUF needed), the copy and long classes with
prompts cut to their last 48 tokens, 6 new tokens, batches 1 and 2, the engines' static forward in mode "eager".
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

import torch

import specdec
from bench import gpu_weights
from bench.common import PROMPT_CLASSES, chat_token_ids, load_prompts
from bench.gpu_steps.common import out_of_time, parse_args, runners, static_stats, stats_delta, write_json
from bench.gpu_steps.e2e import Checked, K, RequestCheckError, engine_kwargs, runner_forward_seconds
from bench.gpu_steps.models import TINY, write_random_llama
from bench.speed.e2e import aggregate_metrics, improvement, interleave, rate, reuse_target_weights, round_mix
from specdec.checkpoint.loader import resolve_model_path
from specdec.tokenizer.tokenizer import Tokenizer

CLASSES = (*PROMPT_CLASSES, "long")
METHODS = ("prompt_lookup", "ngram_table")
BATCHES_ENV = "BENCH_GPU_REAL_BATCHES"  # "1 8 32": bench.gpu passes no step flags, so the batches can come from here
METRICS = ("acceptance_rate", "alpha", "tau", "speculating_step_fraction", "mean_draft_length", "drafted", "accepted",
           "rounds", "per_position_acceptance")  # fmt: skip


class NoWeights(Exception):
    """No SmolLM2 GGUF in the chunk folder (no manifest): the step is skipped, not failed."""


def plan(args) -> dict:
    """The run's shape: the dry run's tiny one or the GPU's, then the command line's overrides."""
    if args.dry_run:
        p = {"batches": [1, 2], "temperatures": [0.0, 0.8], "max_tokens": 6, "reps": 3, "cost_reps": 3,
             "prompt_cap": 48, "static_mode": "eager", "dtype": "bfloat16"}  # fmt: skip
    else:
        p = {"batches": [1, 8], "temperatures": [0.0, 0.8], "max_tokens": 128, "reps": 3, "cost_reps": 5,
             "prompt_cap": None, "static_mode": None, "dtype": "bfloat16"}  # fmt: skip
    if args.batches:
        p["batches"] = args.batches
    elif os.environ.get(BATCHES_ENV):
        p["batches"] = [int(b) for b in os.environ[BATCHES_ENV].split()]
    for key in ("temperatures", "max_tokens", "reps"):
        if getattr(args, key) is not None:
            p[key] = getattr(args, key)
    p["classes"] = args.classes or (["copy", "long"] if args.dry_run else list(CLASSES))
    if p["reps"] < 3 or p["reps"] % 2 == 0:
        raise ValueError(f"--reps must be odd and >= 3 (the median is one run's own time), got {p['reps']}")
    return p


def smollm2_gguf(folder: Path) -> Path:
    """The default model's GGUF reassembled in ``folder`` (joined now if needed; ``bench.gpu_weights.join`` is
    idempotent), checked against MODELS.md's sha256. ``NoWeights`` without its manifest."""
    from specdec.checkpoint.default_model import DEFAULT_MODEL_GGUF, DEFAULT_MODEL_SHA256

    if not gpu_weights.manifest_path(folder, DEFAULT_MODEL_GGUF).is_file():
        raise NoWeights(f"no {DEFAULT_MODEL_GGUF} manifest in {folder}: split it where it is installed and carry the "
                        "chunks (python -m bench.gpu_weights split / plan; docs/benchmarking.md)")
    manifest = gpu_weights.load_manifest(folder, DEFAULT_MODEL_GGUF)
    if manifest["sha256"] != DEFAULT_MODEL_SHA256:
        raise gpu_weights.CorruptChunkError(f"{folder}: the manifest's sha256 {manifest['sha256']} is not SmolLM2's "
                                            f"{DEFAULT_MODEL_SHA256}")
    return gpu_weights.join(folder, DEFAULT_MODEL_GGUF)


class ProposeTimer:
    """Host seconds and calls of an engine's ``proposer.propose`` while ``active`` (an instance attribute that
    wraps the bound method: ``Speculator.draft`` calls ``self.proposer.propose``)."""

    def __init__(self, llm: specdec.LLM):
        proposer = llm.engine.speculative.proposer
        self.inner = proposer.propose
        self.seconds, self.calls, self.active = 0.0, 0, False
        proposer.propose = self

    def __call__(self, requests, num_tokens):
        start = time.perf_counter()
        try:
            return self.inner(requests, num_tokens)
        finally:
            if self.active:
                self.seconds += time.perf_counter() - start
                self.calls += 1

    def start(self) -> None:
        self.seconds, self.calls, self.active = 0.0, 0, True


def build_engines(path: str, p: dict, max_model_len: int) -> dict[str, specdec.LLM]:
    """Plain and one speculative engine per ``METHODS``, sharing the plain engine's weights (one copy)."""
    kwargs = engine_kwargs(p["dtype"], max_model_len, max(p["batches"]))
    plain = specdec.LLM(path, **kwargs)
    engines = {"plain": plain}
    with reuse_target_weights(plain):
        for method in METHODS:
            config = specdec.SpeculativeConfig(method=method, num_speculative_tokens=K)
            engines[method] = specdec.LLM(path, speculative=config, **kwargs)
    if p["static_mode"] is not None:  # the dry run: the static path's bucketing on CPU (CUDA picks graphs itself)
        for llm in engines.values():
            llm.engine.enable_static_forward(p["static_mode"])
    return engines


def target_costs(llm: specdec.LLM, batch: int, context: int, reps: int) -> dict:
    """Decode time and v(j), j = 1..k, through the speculative engine ``llm``'s target runner."""
    runner = runners(llm.engine)["target"]
    one, one_static = runner_forward_seconds(runner, batch, context, 1, reps)
    windows = [runner_forward_seconds(runner, batch, context, j + 1, reps) for j in range(1, K + 1)]
    static = one_static and all(s for _, s in windows)
    path = f"static ({runner.static.mode})" if static and runner.static is not None else "eager forward"
    return {"context": context, "reps": reps, "path": path, "target_1_ms": 1e3 * one,
            "target_j_plus_1_ms": [1e3 * w for w, _ in windows], "v": [w / one for w, _ in windows],
            "v_k": windows[-1][0] / one}  # fmt: skip


def measure(engines: dict, timers: dict, prompts: list[list[int]], params, reps: int, label: str) -> dict:
    """Warm-up (one run of each engine, exactly the timed ones), then ``reps`` interleaved runs of every engine."""
    checked = {name: Checked(llm, params, f"{label} {name}") for name, llm in engines.items()}
    for engine in checked.values():
        engine.run(prompts)
    before = {name: static_stats(llm.engine) for name, llm in engines.items()}
    for timer in timers.values():
        timer.start()
    runs = interleave(checked, prompts, reps)
    for timer in timers.values():
        timer.active = False
    plain_tokens, plain_seconds = rate(runs["plain"])
    plain_rate = plain_tokens / plain_seconds
    out = {"plain": {"tokens_per_s": plain_rate, "seconds": [r["seconds"] for r in runs["plain"]]}, "methods": {},
           "requests_checked": sum(c.checked for c in checked.values()) - len(prompts) * len(checked),
           "static_timed": {name: stats_delta(before[name], static_stats(llm.engine))
                            for name, llm in engines.items()}}  # fmt: skip
    greedy = params.temperature == 0
    for method in METHODS:
        tokens, seconds = rate(runs[method])
        metrics = aggregate_metrics([m for r in runs[method] for m in r["metrics"]])
        timer = timers[method]
        same = all(r["tokens"] == runs["plain"][0]["tokens"] for r in runs[method])
        out["methods"][method] = {
            "tokens_per_s": tokens / seconds, "speedup": tokens / seconds / plain_rate,
            "seconds": [r["seconds"] for r in runs[method]], **{key: metrics[key] for key in METRICS},
            "propose_calls": timer.calls,
            "propose_ms_per_call": 1e3 * timer.seconds / timer.calls if timer.calls else None,
            "identical_to_plain": same if greedy else None,  # sampled tokens differ by design
        }  # fmt: skip
    return out


def describe(label: str, row: dict) -> str:
    """One printed line per measured group."""
    def num(value, spec: str = ".2f") -> str:
        return "-" if value is None else format(value, spec)

    parts = [f"{m} {num(r['tokens_per_s'], '.1f')} tok/s ({num(r['speedup'])}x; predicted Thm+v(k) "
             f"{num(r['predicted_thm_v_k'])}x, mix {num(r['predicted_mix'])}x), accept {num(r['acceptance_rate'])}, "
             f"tau {num(r['tau'])}, f {num(r['speculating_step_fraction'])}, c {num(r['c'], '.4f')}"
             for m, r in row["methods"].items()]  # fmt: skip
    return (f"{label}: plain {num(row['plain']['tokens_per_s'], '.1f')} tok/s; " + "; ".join(parts)
            + f"; v(k) {num(row['costs']['v_k'], '.3f')}")


def predict(group: dict) -> None:
    """c (the drafting overhead per step over k target decodes) and the two predicted speedups, per method."""
    costs = group["costs"]
    for row in group["methods"].values():
        overhead = row["propose_ms_per_call"]
        row["c"] = overhead / (K * costs["target_1_ms"]) if overhead is not None else None
        c = row["c"] or 0.0
        row["predicted_thm_v_k"] = improvement(row["alpha"], K, c, costs["v_k"])
        row["predicted_mix"] = round_mix(row, K, c, costs["v"])


def run(args, p: dict, result: dict, save, work: str) -> None:
    """Load the model (the tiny one in a dry run), tokenise the prompts, build the engines, then every batch,
    temperature and class in that order into ``result["groups"]`` (saved after each), stopping at the deadline."""
    if args.dry_run and args.gguf is None:
        path = write_random_llama(f"{work}/tiny", **TINY, dtype=torch.bfloat16, seed=0, device="cpu")
        result["model"] = {"kind": "tiny random (dry run)", **TINY}
    else:
        gguf = Path(args.gguf) if args.gguf else smollm2_gguf(args.weights_dir)
        path = str(gguf)
        result["model"] = {"kind": "gguf", "path": path, "sha256": gpu_weights.file_sha256(gguf),
                           "size": gguf.stat().st_size}  # fmt: skip
    start = time.time()
    tokenizer = Tokenizer.from_dir(resolve_model_path(path))  # a GGUF is converted here, once (cached)
    ids = {cls: [chat_token_ids(tokenizer, prompt.text) for prompt in prompts]
           for cls, prompts in load_prompts(p["classes"]).items()}  # fmt: skip
    if p["prompt_cap"]:
        ids = {cls: [prompt[-p["prompt_cap"]:] for prompt in prompts] for cls, prompts in ids.items()}
    result["prompt_tokens"] = {cls: [len(prompt) for prompt in prompts] for cls, prompts in ids.items()}
    longest = max(len(prompt) for prompts in ids.values() for prompt in prompts)
    max_model_len = -(-(longest + p["max_tokens"] + K + 2) // 16) * 16
    engines = build_engines(path, p, max_model_len)
    timers = {method: ProposeTimer(engines[method]) for method in METHODS}
    result["load_s"] = time.time() - start
    result["max_model_len"] = max_model_len
    print(f"loaded {result['model']['kind']} in {result['load_s']:.1f} s; prompt tokens {result['prompt_tokens']}",
          flush=True)  # fmt: skip
    costs: dict[tuple[int, str], dict] = {}
    for batch in p["batches"]:
        for temperature in p["temperatures"]:
            params = specdec.SamplingParams(temperature=temperature, max_tokens=p["max_tokens"], ignore_eos=True)
            for cls, prompts in ids.items():
                if out_of_time(args, 5 if args.dry_run else 30):
                    result["stopped_early"] = f"before batch {batch}, T={temperature:g}, {cls}"
                    return
                group = [prompts[i % len(prompts)] for i in range(batch)]
                label = f"batch {batch} T={temperature:g} {cls}"
                row = {"batch": batch, "temperature": temperature, "class": cls, "reps": p["reps"],
                       **measure(engines, timers, group, params, p["reps"], label)}  # fmt: skip
                if (batch, cls) not in costs:  # forward costs do not depend on the temperature
                    context = round(sum(map(len, group)) / batch + p["max_tokens"] / 2)
                    costs[batch, cls] = target_costs(engines[METHODS[0]], batch, context, p["cost_reps"])
                row["costs"] = costs[batch, cls]
                predict(row)
                result["groups"].append(row)
                save()
                print(describe(label, row), flush=True)


def main(argv: list[str] | None = None) -> int:
    def extra(parser):
        parser.add_argument("--gguf", default=None, help="the GGUF to load (default: SmolLM2 from --weights-dir)")
        parser.add_argument("--weights-dir", type=Path, default=gpu_weights.DEFAULT_DIR,
                            help="bench.gpu_weights' chunk folder (default: .gpu_weights in the repository)")
        parser.add_argument("--batches", type=int, nargs="+", default=None, help=f"default 1 8 (or ${BATCHES_ENV})")
        parser.add_argument("--temperatures", type=float, nargs="+", default=None, help="default 0 0.8")
        parser.add_argument("--max-tokens", type=int, default=None, help="new tokens per request (GPU default 128)")
        parser.add_argument("--reps", type=int, default=None, help="timed runs per engine, odd >= 3 (default 3)")
        parser.add_argument("--classes", nargs="+", choices=CLASSES, default=None, help="prompt classes (all)")
        parser.add_argument("--workdir", default=None, help="where the dry run's tiny model goes (a temp dir)")

    args = parse_args(__doc__.splitlines()[0], argv, extra)
    cuda = torch.cuda.is_available() and not args.dry_run
    if not cuda:
        torch.set_num_threads(1)
    p = plan(args)
    result: dict = {"device": torch.cuda.get_device_name() if cuda else "cpu", "dtype": p["dtype"], "k": K,
                    "methods": list(METHODS), "max_tokens": p["max_tokens"], "reps": p["reps"],
                    "batches": p["batches"], "temperatures": p["temperatures"], "classes": p["classes"],
                    "prefix_caching": False, "ignore_eos": True,
                    "warm_up": "one run of each engine on the timed prompts", "groups": []}  # fmt: skip

    def save() -> None:
        write_json(args.out / "real.json", result)

    work = tempfile.mkdtemp(prefix="specdec_real_", dir=args.workdir)
    status = "ok" if cuda else f"ok (CPU{', tiny random model' if args.dry_run and not args.gguf else ''}: not a GPU " \
        "measurement)"
    code = 0
    try:
        run(args, p, result, save, work)
    except NoWeights as why:
        result["skipped"] = str(why)
        status = f"skipped: {why}"
    except (RequestCheckError, gpu_weights.MissingChunkError, gpu_weights.CorruptChunkError) as err:
        result["failure"] = f"{type(err).__name__}: {err}"
        print(f"FAILED: {result['failure']}", flush=True)
        code = 1
    finally:
        save()
        shutil.rmtree(work, ignore_errors=True)
    if code == 0:
        print(f"STATUS: {status}", flush=True)
    return code


if __name__ == "__main__":
    sys.exit(main())
