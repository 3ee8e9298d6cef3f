"""Step breakdown: where a decode step's GPU time goes, kernel group by kernel group, against its memory bound.

Results go into kernels.json under ``"breakdown"`` (the device machine returns 8 files and a full run writes 8).
Models: the e2e step's ``random`` pair (``bench.gpu_steps.e2e.plan``): a Llama-3.2-3B-shaped target and an
independent Llama-3.2-1B-shaped draft, random bf16 weights (``bench.gpu_steps.models``). Cases, in this order:
  decode      one plain decode step (``engine.step`` of a plain engine: the static forward - on CUDA the replay of
              the engine's CUDA graph -, the LM head, greedy sampling) of each model at batch 1 and 8;
  spec round  one speculative round of the 3B drafted by the 1B (k = 4, greedy) at batch 1 and 8, and again with
              the draft's steps one by one (the draft loop set aside: "fused, no draft loop");
  unfused     the same decodes and round with ``ops.fused_forward(False)``: the forward's norms, rope + K/V write
              and SiLU-mul as separate torch ops (the forward before the fused kernels; engines of their own,
              whose CUDA graphs are captured inside that context) - the before/after on one card in one run;
  compile     where the time left allows, the plain decode steps again with the runner's static forward in mode
              "compile" (``torch.compile`` of the same forward: Inductor's fusion, no CUDA graph) - the other fusion
              strategy, to keep whichever is faster. Its warm-up time (the compiles) is recorded apart.
Per case: requests of ``prompt_len`` random ids are stepped until every one is decoding (a speculative one: has
verified once), and once more, so every bucket the measured steps use is captured or compiled; then ``reps``
steps are timed (wall, CUDA-synchronised: replay plus host work; tok/s = tokens emitted / time), then one step runs
under ``torch.profiler`` with CUDA activity (CUPTI records the kernels inside graph replays). Its device events
(kernels, memcpy, memset) are grouped by ``kernel_groups.classify_kernel``: count, microseconds, share of the
step's GPU time (their sum: one stream, so its busy time), the share outside GEMM + attention, the top names.
Bound = bytes / the device-to-device copy bandwidth measured at the start of this step (``copy_bandwidth_gbps``,
read + write, as the kernels step measures it), bytes = for each forward of each runner in the profiled step
(the runners' forward counters) its model's weights (every parameter once; a tied embedding once: the LM head
reads it whole) plus the KV it reads (the running requests' cached tokens x K and V bytes per token over the
layers; the draft's context taken as the target's). Reported: GPU time / bound and steady step time / bound.
Dry run: tiny models on CPU, the static forward in mode "eager", the profile's CPU aten ops by self time
classified by the same rules (coarser: the CPU attention's matmuls and softmax count as GEMM and sampling), no
compile ("skipped: dry run").
"""

from __future__ import annotations

import gc
import json
import shutil
import statistics
import sys
import tempfile
import time

import torch

import specdec
from bench.gpu_steps import e2e
from bench.gpu_steps.common import (
    copy_bandwidth_gbps,
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
from bench.gpu_steps.kernel_groups import GROUPS, cpu_op_rows, device_kernel_rows, group_kernels
from specdec import ops

K = e2e.K
COMPILE_NEED_S = 150  # a model's compile cases are started only with this much time left (two buckets compiled)


def plan(dry: bool) -> dict:
    target_kw, draft_kw = e2e.plan(dry)["pairs"]["random"]
    names = ("tiny target", "tiny draft") if dry else ("Llama-3.2-3B", "Llama-3.2-1B")
    return {"models": dict(zip(names, (target_kw, draft_kw))), "batches": [1, 2] if dry else [1, 8],
            "prompt_len": 16 if dry else 512, "reps": 3 if dry else 20, "warm_max": 12,
            "static_mode": "eager" if dry else None, "compile": not dry, "case_need_s": 5 if dry else 20}  # fmt: skip


def max_new_tokens(p: dict) -> int:
    """A request's ``max_tokens``, never reached in a case (warm-up, timed steps, the profiled one; k + 1 a step)."""
    return (p["warm_max"] + p["reps"] + 4) * (K + 1)


def kv_token_bytes(runner) -> int:
    """K and V bytes of one cached token over every layer of ``runner``'s pool (``[L, blocks, block, Hkv, D]``)."""
    k, _ = runner.pool.tensors
    return 2 * k[:, 0, 0].numel() * k.element_size()


def step_bytes(engine, delta: dict, context_tokens: int) -> dict:
    """The bytes a step must read: per runner, ``forwards`` x (its model's weights + ``context_tokens`` of KV)."""
    per = {}
    for role, runner in runners(engine).items():
        per[role] = {"forwards": delta[role]["forwards"], "weights": forward_weight_bytes(runner.model),
                     "kv": kv_token_bytes(runner) * context_tokens}  # fmt: skip
    return {"runners": per, "context_tokens": context_tokens,
            "total": sum(r["forwards"] * (r["weights"] + r["kv"]) for r in per.values())}  # fmt: skip


def checked_step(engine, ids: list[str]) -> list:
    """``engine.step()``'s outputs of the requests ``ids``; ``RequestCheckError`` if one ended in error or finished
    (the requests are sized never to finish inside a case: a batch that shrinks mid-case would measure another
    step)."""
    outs = [o for o in engine.step() if o.request_id in ids]
    bad = [f"request {o.request_id}: {o.error or o.outputs[0].finish_reason}" for o in outs
           if o.error is not None or o.outputs[0].finish_reason is not None]  # fmt: skip
    if bad:
        raise e2e.RequestCheckError("breakdown: " + "; ".join(bad[:3]))
    return outs


def warm_up(engine, ids: list[str], speculative: bool, warm_max: int):
    """Step until every request of ``ids`` is decoding - two tokens (the prefill's, a decode's), and for a
    speculative engine one verification round - then once more. Returns the tokens each has, the warm-up steps and
    their seconds."""
    tokens: dict[str, int] = {}
    rounds: dict[str, int] = {}
    began, ready = time.time(), 0
    for step in range(1, warm_max + 1):
        for out in checked_step(engine, ids):
            tokens[out.request_id] = len(out.outputs[0].token_ids)
            rounds[out.request_id] = out.metrics.get("num_rounds", 0)
        if len(tokens) == len(ids) and all(tokens[i] >= 2 and (rounds[i] > 0 or not speculative) for i in ids):
            ready += 1
            if ready == 2:
                sync()
                return tokens, step, time.time() - began
    raise e2e.RequestCheckError(f"breakdown: the requests were not all decoding after {warm_max} steps: {tokens}")


def stop(engine, ids: list[str]) -> None:
    """Abort the requests and step until the engine is idle and has handed out their outputs."""
    for request_id in ids:
        engine.abort(request_id)
    engine.step()
    while engine.has_unfinished_requests():
        engine.step()


def timed_steps(engine, ids: list[str], tokens: dict[str, int], reps: int) -> dict:
    """``reps`` steps timed one by one (CUDA-synchronised): median step, tokens emitted per step, tok/s."""
    samples, emitted = [], 0
    for _ in range(reps):
        seconds, outs = synced_timed(lambda: checked_step(engine, ids))
        samples.append(seconds)
        for out in outs:
            n = len(out.outputs[0].token_ids)
            emitted += n - tokens[out.request_id]
            tokens[out.request_id] = n
    return {"steps": reps, "step_ms": 1e3 * statistics.median(samples), "tokens_per_step": emitted / reps,
            "tok_s": emitted / sum(samples)}  # fmt: skip


def profile_step(engine, ids: list[str], cuda: bool) -> tuple[list, dict]:
    """One step under torch.profiler: its kernel rows (device events on CUDA, CPU aten ops otherwise) and the
    static-forward counters of every runner during it."""
    from torch.profiler import ProfilerActivity, profile

    before = static_stats(engine)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    sync()
    with profile(activities=activities) as prof:
        checked_step(engine, ids)
        sync()
    delta = stats_delta(before, static_stats(engine))
    rows = device_kernel_rows(prof.events()) if cuda else cpu_op_rows(prof.key_averages())
    return rows, delta


def run_case(llm: specdec.LLM, label: dict, prompts: list[list[int]], p: dict, cuda: bool, copy_gbps: float) -> dict:
    """One case (``label``: model, step, batch, forward): warm-up, timed steps, the profiled step, its groups and
    bound. ``label["forward"] == "unfused"``: everything inside ``ops.fused_forward(False)``; ``"fused, no draft
    loop"``: the draft model's steps one by one (its draft loop, specdec/runner/draft_loop.py, set aside for the
    case)."""
    draft_model = llm.engine.speculative.proposer.draft_model if llm.engine.speculative is not None else None
    loop = draft_model.loop if draft_model is not None else None
    if loop is not None and label.get("forward") == "fused, no draft loop":
        draft_model.loop = None
    try:
        with ops.fused_forward(label.get("forward", "fused") != "unfused"):
            return _run_case(llm, label, prompts, p, cuda, copy_gbps)
    finally:
        if draft_model is not None:
            draft_model.loop = loop


def _run_case(llm: specdec.LLM, label: dict, prompts: list[list[int]], p: dict, cuda: bool, copy_gbps: float) -> dict:
    engine = llm.engine
    speculative = label["step"] == "spec round"
    params = specdec.SamplingParams(temperature=0, max_tokens=max_new_tokens(p), ignore_eos=True)
    ids = [engine.add_request(prompt_token_ids=prompt, params=params) for prompt in prompts]
    try:
        tokens, warm_steps, warm_s = warm_up(engine, ids, speculative, p["warm_max"])
        steady = timed_steps(engine, ids, tokens, p["reps"])
        context_tokens = sum(len(prompt) + tokens[i] for prompt, i in zip(prompts, ids))  # cached before the step
        rows, delta = profile_step(engine, ids, cuda)
    finally:
        stop(engine, ids)
    grouped = group_kernels(rows)
    nbytes = step_bytes(engine, delta, context_tokens)
    bound_us = nbytes["total"] / (copy_gbps * 1e3)
    return {**label, "mode": delta["target"]["mode"] or "eager forward", "warm_up": {"steps": warm_steps, "s": warm_s},
            "steady": steady, "static": delta, "bytes": nbytes, "bound_us": bound_us,
            "gpu_over_bound": grouped["us"] / bound_us, "step_over_bound": 1e3 * steady["step_ms"] / bound_us,
            "source": "CUDA device events (CUPTI)" if cuda else "CPU aten ops (self time)", **grouped}  # fmt: skip


def describe(case: dict) -> str:
    shares = ", ".join(f"{g} {case['groups'][g]['share']:.0%} ({case['groups'][g]['kernels']})" for g in GROUPS)
    top = "\n".join(f"    {us:9.1f} us x{n:<5d} {group:22s} {name[:110]}" for name, group, n, us in case["top"])
    return (f"{case['model']} {case['step']} batch {case['batch']} ({case['mode']}, {case.get('forward', 'fused')} "
            f"forward): {case['kernels']} kernels, "
            f"{case['us']:.0f} us ({case['source']}), bound {case['bound_us']:.0f} us, GPU / bound "
            f"{case['gpu_over_bound']:.2f}, steady step {case['steady']['step_ms']:.3f} ms = "
            f"{case['step_over_bound']:.2f} x bound, {case['steady']['tok_s']:.0f} tok/s, outside GEMM + attention "
            f"{case['outside_gemm_attention']:.0%}\n  {shares}\n  top:\n{top}")  # fmt: skip


def measure(args, p: dict, work: str, cuda: bool, result: dict, save) -> None:
    (name3, kw3), (name1, kw1) = p["models"].items()
    target, draft, seconds = e2e.write_pair(work, "breakdown", kw3, kw1, torch.bfloat16)
    print(f"wrote the random models in {seconds:.0f} s", flush=True)
    max_batch = max(p["batches"])
    max_model_len = -(-(p["prompt_len"] + max_new_tokens(p) + K + 2) // 16) * 16
    plain3, spec = e2e.engines(target, draft, "bfloat16", max_model_len, max_batch, p["static_mode"])
    plain1 = specdec.LLM(draft, **e2e.engine_kwargs("bfloat16", max_model_len, max_batch))
    if p["static_mode"] is not None:
        plain1.engine.enable_static_forward(p["static_mode"])
    vocab = kw3["vocab_size"]
    prompts = torch.randint(300, vocab, (max_batch, p["prompt_len"]), generator=torch.Generator().manual_seed(5))
    prompts = prompts.tolist()
    copy_gbps = result["copy"]["copy_GBps"]
    def unfused_engines():  # engines of their own: a CUDA graph replays whatever forward it captured
        plain3_u, spec_u = e2e.engines(target, draft, "bfloat16", max_model_len, max_batch, p["static_mode"])
        plain1_u = specdec.LLM(draft, **e2e.engine_kwargs("bfloat16", max_model_len, max_batch))
        if p["static_mode"] is not None:
            plain1_u.engine.enable_static_forward(p["static_mode"])
        return plain3_u, plain1_u, spec_u

    spec_label = {"model": f"{name3}, {name1} drafting", "step": "spec round"}
    todo = [(plain3, {"model": name3, "step": "decode", "forward": "fused"}),
            (plain1, {"model": name1, "step": "decode", "forward": "fused"}),
            (spec, {**spec_label, "forward": "fused"}),
            (spec, {**spec_label, "forward": "fused, no draft loop"})]  # the draft loop's saving, same engine
    plain3_u, plain1_u, spec_u = unfused_engines()
    todo += [(plain3_u, {"model": name3, "step": "decode", "forward": "unfused"}),
             (plain1_u, {"model": name1, "step": "decode", "forward": "unfused"}),
             (spec_u, {**spec_label, "forward": "unfused"})]  # fmt: skip
    for llm, label in todo:
        for batch in p["batches"]:
            if out_of_time(args, p["case_need_s"]):
                result["stopped_early"] = f"before {label['model']} {label['step']} batch {batch}"
                return
            case = run_case(llm, {**label, "batch": batch}, prompts[:batch], p, cuda, copy_gbps)
            result["cases"].append(case)
            print(describe(case), flush=True)
            save()
    if not p["compile"]:
        result["compile"] = "skipped: dry run (torch.compile of even a tiny model takes ~20 s a bucket on CPU)"
        return
    for llm, name in ((plain1, name1), (plain3, name3)):
        if out_of_time(args, COMPILE_NEED_S):
            result["compile"] = f"stopped early: out of time before {name}"
            return
        try:
            llm.engine.enable_static_forward("compile")  # ValueError: weights it cannot trace (CPU prepacked copies)
            for batch in p["batches"]:
                case = run_case(llm, {"model": name, "step": "decode", "batch": batch, "forward": "compiled"},
                                prompts[:batch], p, cuda, copy_gbps)  # fmt: skip
                result["cases"].append(case)
                print(describe(case), flush=True)
                save()
        except (ValueError, RuntimeError) as err:  # a failed compile ends the requests (e2e.RequestCheckError)
            result["compile"] = f"failed ({name}): {str(err)[:500]}"
            print(f"compile mode, {name}: FAILED: {err}", flush=True)
            return  # a compile that fails on one model would fail on the other too: keep the device time
    result["compile"] = "ran"


def main(argv: list[str] | None = None) -> int:
    def extra(parser):
        parser.add_argument("--workdir", default=None, help="where the random models go (default: a temp dir)")

    args = parse_args(__doc__.splitlines()[0], argv, extra)
    cuda = torch.cuda.is_available() and not args.dry_run
    if not cuda:
        torch.set_num_threads(1)
    p = plan(args.dry_run)
    path = args.out / "kernels.json"
    try:  # the kernels step's file, when it ran before this one
        kernels = json.loads(path.read_text())
    except (OSError, ValueError):
        kernels = {}
    result: dict = {"device": torch.cuda.get_device_name() if cuda else "cpu", "dtype": "bfloat16", "k": K,
                    "prompt_len": p["prompt_len"], "reps": p["reps"], "batches": p["batches"],
                    "models": dict(p["models"]), "groups": list(GROUPS), "cases": []}
    kernels["breakdown"] = result

    def save() -> None:
        write_json(path, kernels)

    result["copy"] = copy_bandwidth_gbps(1024 if cuda else 16, reps=20 if cuda else 3)
    print(f"device-to-device copy: {result['copy']['copy_GBps']:.0f} GB/s (read + write)", flush=True)
    save()
    work = tempfile.mkdtemp(prefix="specdec_gpu_breakdown_", dir=args.workdir)
    failure = None
    try:
        measure(args, p, work, cuda, result, save)
    except e2e.RequestCheckError as err:
        failure = result["failure"] = str(err)
    finally:
        save()
        shutil.rmtree(work, ignore_errors=True)
        gc.collect()
    if failure is not None:
        print(f"FAILED: {failure}", flush=True)
        return 1
    if not cuda:
        print("STATUS: ok (CPU aten ops of tiny models: the code path, not a GPU measurement)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
