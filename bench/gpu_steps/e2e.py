"""Step e2e: plain vs speculative decoding end to end on random-weight models (e2e.json, profile.txt).

Pairs (bf16, greedy, k = 4, ``ignore_eos``, random prompt ids), in this order (the orchestrator runs this step
first, and a pair cut by the time limit is the last one):
  damped   target Llama-3.2-1B-shaped whose layers >= 2 write into the residual stream scaled by 0.1, draft its
           first 2 layers (same weights): a draft of known (measured) and substantial acceptance;
  random   target Llama-3.2-3B-shaped, draft Llama-3.2-1B-shaped, independent random weights: the two do not
           agree (acceptance ~0), so this pair measures costs - c, v(k), the engine's overheads - not a speedup.
Per pair and batch size (1, 8, 64): a warm-up that is one run of exactly the timed generate (same prompts, same
``max_tokens``: every CUDA-graph bucket the timed runs use - k + 1 = 5-token windows included - is captured
before timing), then ``bench.speed.e2e.phase_a`` (plain and speculative engines sharing the target's weights, ``reps``
interleaved runs each, an odd number >= 3 so the median is a run's own time; tokens/s = generated tokens / wall
time of ``generate``, prefill included), the acceptance, alpha and tau. Prefix caching is off in every engine
(on, the target would skip the prompt of every repeated run and the draft would not). Every run checks every
request: no ``error``, ``finish_reason == "length"`` and exactly ``max_tokens`` tokens - a kernel fault that
ends requests early fails the step instead of showing plausible tok/s. Static-forward counters (replays,
fallbacks, eager forwards, buckets captured) of every runner - the target's and the draft's - are recorded for
the warm-up and the timed runs. c = draft decode / target decode and v(j) = target forward of j + 1 tokens per
request / of 1 token are timed through the speculative engine's own runners (their static forward - CUDA graphs
on CUDA - when the batch has a bucket, as the engine runs them; ``costs``) and, for comparison with earlier runs,
through a fresh eager runner (``costs_eager``, ``bench.speed.e2e.measure_costs``), CUDA-synchronised. And c once more
with the draft's LM head cut to a reduced draft vocabulary (``costs_draft_vocab``: a third engine, the same draft
with ``SpeculativeConfig(draft_vocab=)`` of ``DRAFT_VOCAB_SIZE`` fixed seeded ids - for random weights any subset
prices the same - through its own runners), the cost the issue's c goal is judged on.
Then CUDA graphs vs ``enforce_eager=True`` for plain decoding of the random target, one speculative round at
batch 8 of the random pair under ``torch.profiler`` (top ops in profile.txt; host syncs counted by kind inside
``engine.step`` only: stream, device and event synchronisations, blocking ``cudaMemcpy`` apart from
``cudaMemcpyAsync``, device-side ``cudaStreamWaitEvent``, ``item()``, kernel and graph launches), and a small
fp32 pair: are greedy speculative tokens identical to plain greedy ones on this device?
Dry run: the same on CPU with tiny models (hidden 64, 2 layers, vocab 512), batch 1 and 2, 8 new tokens, 3 reps,
the engines' static forward in mode "eager" (the graph path's bucketing and counters, without graphs).
"""

from __future__ import annotations

import gc
import shutil
import statistics
import sys
import tempfile
import time

import torch

import specdec
from bench.gpu_steps.common import (
    cuda_synced_timing,
    forward_weight_bytes,
    out_of_time,
    parse_args,
    runners,
    static_stats,
    stats_delta,
    sync,
    synced_timed,
    write_json,
)
from bench.gpu_steps.models import LLAMA_1B, LLAMA_3B, TINY, write_random_llama
from bench.speed.e2e import Ours, measure_costs, phase_a, reuse_target_weights
from specdec.runner.model_runner import ForwardItem

K = 4
DRAFT_VOCAB_SIZE = 32000  # the reduced draft vocabulary c is also timed with (EAGLE-3's usual size); dry run: 256
STEP_LABEL = "bench.gpu: engine.step"  # the profiled round's record_function; events are counted inside it only
# (event name, what it is) in the order summary.md lists them
PROFILE_EVENTS = {
    "cudaStreamSynchronize": "stream syncs (host waits)",
    "cudaDeviceSynchronize": "device syncs (host waits)",
    "cudaEventSynchronize": "event syncs (host waits)",
    "cudaMemcpy": "blocking cudaMemcpy (host waits)",
    "cudaMemcpyAsync": "cudaMemcpyAsync (non-blocking)",
    "cudaStreamWaitEvent": "cudaStreamWaitEvent (device-side wait)",
    "aten::_local_scalar_dense": "item() reads",
    "cudaLaunchKernel": "cudaLaunchKernel",
    "cuLaunchKernel": "cuLaunchKernel (Triton)",
    "cudaGraphLaunch": "CUDA graph launches",
}
HOST_WAITS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize", "cudaMemcpy")
SCRATCH_SEQ_BASE = -1000  # runner_forward_seconds' sequences (the scratch block's pseudo-sequence is -1)


class RequestCheckError(RuntimeError):
    """A request of a measured run ended in error or short of its length."""


def plan(dry: bool) -> dict:
    if dry:
        small = dict(TINY, num_layers=2)
        return {"batches": [1, 2], "prompt_len": 16, "max_tokens": 8, "reps": 3, "cost_reps": 3, "profile_batch": 2,
                "static_mode": "eager",
                "pairs": {"damped": ({**small, "seed": 3, "damp_from": 1, "damp": 0.1},
                                     {**small, "seed": 3, "truncate_to": 1}),
                          "random": ({**small, "seed": 1}, {**small, "seed": 2})},
                "fp32": ({**small, "seed": 5, "damp_from": 1, "damp": 0.1}, {**small, "seed": 5, "truncate_to": 1})}
    fp32 = dict(hidden_size=256, num_layers=4, num_heads=4, num_kv_heads=2, intermediate_size=1024, vocab_size=4096)
    return {"batches": [1, 8, 64], "prompt_len": 128, "max_tokens": 64, "reps": 5, "cost_reps": 5, "profile_batch": 8,
            "static_mode": None,  # the engine's own choice: CUDA graphs on CUDA
            "pairs": {"damped": ({**LLAMA_1B, "seed": 3, "damp_from": 2, "damp": 0.1},
                                 {**LLAMA_1B, "seed": 3, "truncate_to": 2}),
                      "random": ({**LLAMA_3B, "seed": 1}, {**LLAMA_1B, "seed": 2})},
            "fp32": ({**fp32, "seed": 5, "damp_from": 2, "damp": 0.1}, {**fp32, "seed": 5, "truncate_to": 2})}


def check_outputs(outs: list, max_tokens: int, label: str) -> None:
    """Raise ``RequestCheckError`` unless every request ended without error, by length, with ``max_tokens`` tokens
    (the runs use ``ignore_eos``: anything else is a fault, whatever the tok/s)."""
    bad = []
    for out in outs:
        completion = out.outputs[0]
        if out.error is not None or completion.finish_reason != "length" or len(completion.token_ids) != max_tokens:
            bad.append(f"request {out.request_id}: finish_reason {completion.finish_reason!r}, "
                       f"{len(completion.token_ids)}/{max_tokens} tokens, error {out.error!r}")
    if bad:
        raise RequestCheckError(f"{label}: {len(bad)} of {len(outs)} requests did not complete: " + "; ".join(bad[:3]))


class Checked(Ours):
    """``bench.speed.e2e.Ours`` (one timed ``generate``, CUDA-synchronised) that checks every output (``check_outputs``)
    and counts the requests it checked."""

    def __init__(self, llm: specdec.LLM, params: specdec.SamplingParams, label: str):
        super().__init__(llm, params)
        self.label = label
        self.checked = 0

    def run(self, prompts: list[list[int]]) -> dict:
        seconds, outs = synced_timed(lambda: self.llm.generate(prompt_token_ids=prompts, sampling_params=self.params))
        check_outputs(outs, self.params.max_tokens, self.label)
        self.checked += len(outs)
        return {"seconds": seconds, "tokens": [o.outputs[0].token_ids for o in outs],
                "metrics": [o.metrics for o in outs]}


def write_pair(work: str, name: str, target_kw: dict, draft_kw: dict, dtype: torch.dtype) -> tuple[str, str, float]:
    start = time.time()
    target = write_random_llama(f"{work}/{name}_target", dtype=dtype, **target_kw)
    draft = write_random_llama(f"{work}/{name}_draft", dtype=dtype, **draft_kw)
    return target, draft, time.time() - start


def engine_kwargs(dtype: str, max_model_len: int, max_batch: int) -> dict:
    # prefix caching off: every timed run prefills its prompt in both models, as the first one does; the
    # batch-invariant kernels off: the GPU's default, which the CPU dry run mirrors (on an AMX CPU they would be on)
    return {"dtype": dtype, "max_model_len": max_model_len, "seed": 0, "max_num_seqs": max(64, max_batch),
            "num_kv_blocks": max_batch * (max_model_len // 16 + 1) + 2, "enable_prefix_caching": False,
            "batch_invariant": False}  # fmt: skip


def engines(target: str, draft: str, dtype: str, max_model_len: int, max_batch: int, static_mode: str | None):
    kwargs = engine_kwargs(dtype, max_model_len, max_batch)
    plain = specdec.LLM(target, **kwargs)
    with reuse_target_weights(plain):  # one copy of the target's weights for both engines
        spec = specdec.LLM(target, speculative=specdec.SpeculativeConfig(
            method="draft_model", draft_model=draft, num_speculative_tokens=K), **kwargs)  # fmt: skip
    if static_mode is not None:  # the dry run: the static path's bucketing on CPU (CUDA picks "cuda_graph" itself)
        for llm in (plain, spec):
            llm.engine.enable_static_forward(static_mode)
    return plain, spec


def draft_vocab_engine(plain: specdec.LLM, target: str, draft: str, vocab: int, max_model_len: int, max_batch: int,
                       static_mode: str | None) -> specdec.LLM:
    """A speculative engine whose draft's LM head keeps ``DRAFT_VOCAB_SIZE`` fixed seeded ids (half the
    vocabulary when that is smaller: the dry run's 512 ids give 256), sharing ``plain``'s target weights."""
    import os

    from specdec.spec_decode.proposers.draft_vocab import write_draft_vocab

    size = min(DRAFT_VOCAB_SIZE, vocab // 2)
    ids = torch.randperm(vocab, generator=torch.Generator().manual_seed(11))[:size].tolist()
    path = os.path.join(os.path.dirname(os.path.abspath(draft)), f"draft_vocab_{size}.json")
    write_draft_vocab(path, ids, [1] * size, vocab)
    with reuse_target_weights(plain):
        spec = specdec.LLM(target, speculative=specdec.SpeculativeConfig(
            method="draft_model", draft_model=draft, num_speculative_tokens=K, draft_vocab=path),
            **engine_kwargs("bfloat16", max_model_len, max_batch))  # fmt: skip
    if static_mode is not None:
        spec.engine.enable_static_forward(static_mode)
    return spec


def draft_costs(spec: specdec.LLM, batch: int, context: int, reps: int, target_1_ms: float) -> dict:
    """c of ``spec``'s draft against a target decode already timed (``target_1_ms``, from ``graph_costs`` of the
    engine with the same target): only the draft's runner is timed again."""
    draft = runners(spec.engine)["draft"]
    seconds, replayed = runner_forward_seconds(draft, batch, context, 1, reps)
    path = f"static ({draft.static.mode})" if replayed and draft.static is not None else "eager forward"
    return {"context": context, "reps": reps, "draft_1_ms": 1e3 * seconds, "c": 1e3 * seconds / target_1_ms,
            "path": {"draft": path}}


def byte_shares(spec: specdec.LLM, spec_dv: specdec.LLM) -> dict:
    """The draft's weight bytes over the target's (``common.forward_weight_bytes``: what one forward reads, KV left
    out), with its full LM head and with the reduced draft vocabulary's: the floor c is judged against."""
    target = forward_weight_bytes(runners(spec.engine)["target"].model)
    return {"full_vocab": forward_weight_bytes(runners(spec.engine)["draft"].model) / target,
            "draft_vocab": forward_weight_bytes(runners(spec_dv.engine)["draft"].model) / target}


def runner_forward_seconds(runner, batch: int, context: int, q_len: int, reps: int) -> tuple[float, bool]:
    """Median seconds of one forward through ``runner`` itself (an engine's ``ModelRunner``: a uniform batch takes
    its static forward - a CUDA graph replay on CUDA - when a bucket serves it, exactly as in the engine) over
    ``batch`` sequences with ``context`` tokens cached, each feeding ``q_len`` new ones with logits for all of them.
    The sequences are scratch ones in the runner's block manager, freed afterwards: the engine must be idle. Also
    returns whether every timed forward was a static replay."""
    bm = runner.block_manager
    vocab = runner.model.config.vocab_size
    gen = torch.Generator().manual_seed(0)
    seq_ids = [SCRATCH_SEQ_BASE - i for i in range(batch)]
    try:
        items = []
        for seq_id in seq_ids:
            bm.allocate(seq_id, context + q_len)
            items.append(ForwardItem(seq_id, torch.randint(0, vocab, (q_len,), generator=gen).tolist(), context, q_len))
        runner.forward(items)  # warm-up (captures the bucket if the engine's runs did not use it)
        replays = runner.static.num_replays if runner.static is not None else 0
        samples = [synced_timed(lambda: runner.forward(items))[0] for _ in range(reps)]
        replayed = (runner.static.num_replays if runner.static is not None else 0) - replays == reps
    finally:
        for seq_id in seq_ids:
            bm.free(seq_id)
    return statistics.median(samples), replayed


def graph_costs(spec: specdec.LLM, batch: int, context: int, k: int, reps: int) -> dict:
    """c and v(j), j = 1..k, through the speculative engine's own runners (``runner_forward_seconds``)."""
    found = runners(spec.engine)
    target, draft = found["target"], found["draft"]
    one, one_static = runner_forward_seconds(target, batch, context, 1, reps)
    windows = [runner_forward_seconds(target, batch, context, j + 1, reps) for j in range(1, k + 1)]
    draft_one, draft_static = runner_forward_seconds(draft, batch, context, 1, reps)
    static = one_static and all(s for _, s in windows)

    def path(runner, replayed: bool) -> str:  # "static (cuda_graph)" on CUDA, "static (eager)" in the dry run
        return f"static ({runner.static.mode})" if replayed and runner.static is not None else "eager forward"

    return {"context": context, "reps": reps,
            "path": {"target": path(target, static), "draft": path(draft, draft_static)},
            "target_1_ms": 1e3 * one, "target_j_plus_1_ms": [1e3 * w for w, _ in windows],
            "draft_1_ms": 1e3 * draft_one, "c": draft_one / one, "v": [w / one for w, _ in windows],
            "v_k": windows[-1][0] / one}  # fmt: skip


def count_events(events, label: str = STEP_LABEL) -> dict:
    """``PROFILE_EVENTS`` counted among the profiler's ``events`` that lie inside the host-side
    ``record_function(label)`` range (the bench's own synchronisation after it is not the engine's), and over the
    whole profile for comparison. ``host_waits``: the calls inside the range that block the host (stream, device and
    event synchronisations, blocking ``cudaMemcpy``); ``cudaMemcpyAsync`` and ``cudaStreamWaitEvent`` do not."""
    # on CUDA the range is also recorded as a GPU-side annotation of the same name: take the host's
    window = next((e.time_range for e in events if e.name == label and
                   str(getattr(e, "device_type", "CPU")).endswith("CPU")), None)  # fmt: skip
    inside = [e for e in events if window is None or (window.start <= e.time_range.start and
                                                      e.time_range.end <= window.end)]  # fmt: skip
    counts = {name: sum(1 for e in inside if e.name == name) for name in PROFILE_EVENTS}
    return {"counts": counts, "host_waits": sum(counts[name] for name in HOST_WAITS),
            "counts_whole_profile": {name: sum(1 for e in events if e.name == name) for name in PROFILE_EVENTS},
            "window": label if window is not None else "the whole profile (no engine.step range found)"}


def profile_round(spec: specdec.LLM, prompts: list[list[int]], max_tokens: int) -> tuple[dict, str]:
    """One speculative round (engine.step after every request has verified once) under torch.profiler."""
    from torch.profiler import ProfilerActivity, profile, record_function

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
        with record_function(STEP_LABEL):
            outs = engine.step()
        sync()
    errors = [f"request {o.request_id}: {o.error}" for o in outs if o.error is not None]
    for request_id in ids:
        engine.abort(request_id)
    while engine.has_unfinished_requests():
        engine.step()
    if errors:
        raise RequestCheckError("the profiled round: " + "; ".join(errors[:3]))
    counts = count_events(prof.events())
    sort = "self_cuda_time_total" if cuda else "self_cpu_time_total"
    table = prof.key_averages().table(sort_by=sort, row_limit=40, max_name_column_width=60)
    return counts, table


def timed_pair(plain: Checked, spec: Checked, prompts: list[list[int]], batch: int, reps: int) -> dict:
    """Warm-up (one run of each engine, exactly the timed ones), then ``phase_a``; the static-forward counters of
    every runner of both engines for the warm-up and for the timed runs."""
    llms = {"plain": plain.llm, "spec": spec.llm}
    before = {name: static_stats(llm.engine) for name, llm in llms.items()}
    plain.run(prompts)
    spec.run(prompts)
    warm = {name: static_stats(llm.engine) for name, llm in llms.items()}
    checked = plain.checked + spec.checked
    row = phase_a(plain, spec, {"ids": prompts}, batch, reps)["ids"]
    after = {name: static_stats(llm.engine) for name, llm in llms.items()}
    row["reps"] = reps
    row["requests_checked"] = plain.checked + spec.checked - checked
    row["static"] = {"warm_up": {n: stats_delta(before[n], warm[n]) for n in llms},
                     "timed": {n: stats_delta(warm[n], after[n]) for n in llms}}  # fmt: skip
    return row


def graphs_vs_eager(plain: specdec.LLM, target: str, prompts: list[list[int]], params, p: dict,
                    max_model_len: int) -> dict:
    """Plain decoding as the engine runs it (CUDA graphs on CUDA) against ``enforce_eager=True``, interleaved, at
    the batch sizes up to 8: what the graphs buy, and whether they were really replayed (no silent fallback)."""
    with reuse_target_weights(plain):
        eager = specdec.LLM(target, enforce_eager=True, **engine_kwargs("bfloat16", max_model_len, max(p["batches"])))
    out = {}
    for batch in [b for b in p["batches"] if b <= 8]:
        row = timed_pair(Checked(eager, params, f"eager batch {batch}"),
                         Checked(plain, params, f"graphs batch {batch}"), prompts[:batch], batch, p["reps"])
        out[str(batch)] = {"eager_tokens_per_s": row["plain_tokens_per_s"], "graphs_tokens_per_s":
                           row["spec_tokens_per_s"], "speedup": row["speedup"], "reps": row["reps"],
                           "identical_tokens": row["identical_tokens"], "requests_checked": row["requests_checked"],
                           "static_timed": {"eager": row["static"]["timed"]["plain"],
                                            "graphs": row["static"]["timed"]["spec"]}}  # fmt: skip
    del eager
    return out


def run_pair(args, name: str, target: str, draft: str, p: dict, result: dict, save) -> None:
    vocab = p["pairs"][name][0]["vocab_size"]
    gen = torch.Generator().manual_seed(7)
    max_batch = max(p["batches"])
    prompts = torch.randint(300, vocab, (max_batch, p["prompt_len"]), generator=gen).tolist()
    max_model_len = -(-(p["prompt_len"] + p["max_tokens"] + K + 2) // 16) * 16
    start = time.time()
    plain, spec = engines(target, draft, "bfloat16", max_model_len, max_batch, p["static_mode"])
    entry = result["pairs"][name] = {"load_s": time.time() - start, "batches": {}}
    params = specdec.SamplingParams(temperature=0, max_tokens=p["max_tokens"], ignore_eos=True)
    found = runners(spec.engine)
    target_model, draft_model = found["target"].model, found["draft"].model
    context = p["prompt_len"] + p["max_tokens"] // 2
    spec_dv = draft_vocab_engine(plain, target, draft, vocab, max_model_len, max_batch, p["static_mode"])
    with cuda_synced_timing():
        for batch in p["batches"]:
            if out_of_time(args, 30 if args.dry_run else 60):
                entry["stopped_early"] = f"before batch {batch}"
                break
            row = timed_pair(Checked(plain, params, f"{name} plain batch {batch}"),
                             Checked(spec, params, f"{name} speculative batch {batch}"), prompts[:batch], batch,
                             p["reps"])  # fmt: skip
            row["costs"] = graph_costs(spec, batch, context, K, p["cost_reps"])
            row["costs_eager"] = measure_costs(target_model, draft_model, target_model.config, draft_model.config,
                                               batch, context, K)  # fmt: skip
            row["costs_draft_vocab"] = {**draft_costs(spec_dv, batch, context, p["cost_reps"],
                                                      row["costs"]["target_1_ms"]),
                                        "draft_vocab_size": min(DRAFT_VOCAB_SIZE, vocab // 2)}
            row["byte_share"] = byte_shares(spec, spec_dv)
            entry["batches"][str(batch)] = row
            save()
        if name == "random" and not out_of_time(args, 30 if args.dry_run else 60):
            entry["graphs_vs_eager"] = graphs_vs_eager(plain, target, prompts, params, p, max_model_len)
            save()
        if name == "random" and not out_of_time(args, 20):
            counts, table = profile_round(spec, prompts[: p["profile_batch"]], p["max_tokens"])
            result["profile"] = {"pair": name, "batch": p["profile_batch"], **counts}
            header = (f"torch.profiler, one speculative round (engine.step) of the {name} pair at batch "
                      f"{p['profile_batch']}, k={K}\nevents inside {counts['window']}: {counts['counts']} (host "
                      f"waits: {counts['host_waits']})\nthe same over the whole profile (the bench's closing "
                      f"synchronize included): {counts['counts_whole_profile']}\n\n")  # fmt: skip
            (args.out / "profile.txt").write_text(header + table + "\n")
            save()
    del plain, spec, spec_dv, target_model, draft_model, found
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def fp32_identity(args, work: str, p: dict, result: dict) -> None:
    """Greedy speculative tokens vs plain greedy tokens, fp32, batch 4: identical on this device?"""
    target, draft, _ = write_pair(work, "fp32", *p["fp32"], torch.float32)
    vocab = p["fp32"][0]["vocab_size"]
    prompts = torch.randint(300, vocab, (4, 24), generator=torch.Generator().manual_seed(3)).tolist()
    plain, spec = engines(target, draft, "float32", 128, 4, p["static_mode"])
    params = specdec.SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    a = plain.generate(prompt_token_ids=prompts, sampling_params=params)
    b = spec.generate(prompt_token_ids=prompts, sampling_params=params)
    check_outputs(a, 32, "fp32 plain")
    check_outputs(b, 32, "fp32 speculative")
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
    assert p["reps"] >= 3 and p["reps"] % 2 == 1, "an odd number >= 3 of runs: the median is one run's time"
    work = tempfile.mkdtemp(prefix="specdec_gpu_models_", dir=args.workdir)
    result: dict = {"device": torch.cuda.get_device_name() if cuda else "cpu", "dtype": "bfloat16", "k": K,
                    "method": "draft_model", "temperature": 0, "prompt_len": p["prompt_len"],
                    "max_tokens": p["max_tokens"], "reps": p["reps"], "batches": p["batches"],
                    "prefix_caching": False, "warm_up": "one run of each timed generate (same prompts and length)",
                    "checked": "every request: no error, finish_reason 'length', max_tokens tokens",
                    "models": {n: {"target": t, "draft": d} for n, (t, d) in p["pairs"].items()},
                    "pairs": {}}  # fmt: skip

    def save() -> None:
        write_json(args.out / "e2e.json", result)

    failure = None
    try:
        for name, (target_kw, draft_kw) in p["pairs"].items():
            if out_of_time(args, 60 if not args.dry_run else 10):
                result.setdefault("not_run", []).append(name)
                continue
            target, draft, seconds = write_pair(work, name, target_kw, draft_kw, torch.bfloat16)
            print(f"{name}: wrote random models in {seconds:.0f} s", flush=True)
            result.setdefault("write_models_s", {})[name] = seconds
            run_pair(args, name, target, draft, p, result, save)
            shutil.rmtree(f"{work}/{name}_target", ignore_errors=True)
            shutil.rmtree(f"{work}/{name}_draft", ignore_errors=True)
        if not out_of_time(args, 20):
            fp32_identity(args, work, p, result)
    except RequestCheckError as err:
        failure = result["failure"] = str(err)
    finally:
        save()
        shutil.rmtree(work, ignore_errors=True)
    for name, entry in result["pairs"].items():
        for batch, row in entry["batches"].items():
            print(f"{name} batch {batch}: plain {row['plain_tokens_per_s']:.1f} tok/s, spec "
                  f"{row['spec_tokens_per_s']:.1f} tok/s ({row['speedup']:.2f}x, median of {row['reps']}), acceptance "
                  f"{row['acceptance_rate']}, tau {row['tau']}, c {row['costs']['c']:.3f}, v(k) "
                  f"{row['costs']['v_k']:.3f} ({row['costs']['path']['target']})")  # fmt: skip
    if failure is not None:
        print(f"FAILED: {failure}", flush=True)
        return 1
    if not cuda:
        print("STATUS: ok (CPU, tiny models: not a GPU measurement)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
