"""Step summary: summary.md from the other steps' files, ready to paste into docs/results.md.

The projection uses ``bench.speed.e2e.improvement`` (Theorem 3.8 of Leviathan et al. with the measured verification
cost: (1 - a^(k+1)) / ((1 - a) (k c + v(k)))), the formula ``python -m bench.speed.e2e`` prints as "Thm+v(k)".
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

from bench.gpu_steps.common import parse_args
from bench.gpu_steps.summary_breakdown import section_breakdown
from bench.gpu_steps.summary_real import section_real


def load(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}


def fmt(value, digits: int = 3) -> str:
    if value is None:
        return "-"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, float):
        return f"{value:.{digits}f}" if abs(value) < 100 else f"{value:.0f}"
    return str(value)


def table(header: list[str], rows: list[list]) -> list[str]:
    return ["| " + " | ".join(header) + " |", "|" + "---|" * len(header),
            *("| " + " | ".join(fmt(v) for v in row) + " |" for row in rows), ""]  # fmt: skip


def log_lines(path: Path, pattern: str) -> list[str]:
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return []
    return [line.strip() for line in text.splitlines() if re.search(pattern, line)]


def section_env(env: dict, run: dict) -> list[str]:
    probe = env.get("cuda_probe") or {}
    lines = [f"## GPU run: {env.get('device', '?')} ({run.get('date', '?')})", ""]
    if run.get("dry_run"):
        lines += ["**Dry run** (CPU, tiny shapes): proves the command and its files; no figure below is a GPU "
                  "measurement.", ""]  # fmt: skip
    lines += [f"- device: {env.get('device')}, {env.get('sm_count')} SMs, {env.get('memory_gib', '-')} GiB; "
              f"nvidia-smi: {env.get('nvidia_smi') or 'not found'}",
              f"- torch {env.get('torch')}, triton {env.get('triton')}, CUDA {env.get('cuda_runtime')}, "
              f"Python {env.get('python')}",
              f"- git commit {env.get('git_commit')} (source digest {env.get('source_digest', '-')}); specdec imported "
              f"from {run.get('layout', '?')}",
              f"- CUDA probed by the orchestrator: {fmt(probe.get('available'))} ({probe.get('detail', '?')}, "
              f"{probe.get('seconds', '?')} s); steps ran with TRITON_INTERPRET={env.get('TRITON_INTERPRET')}",
              f"- command: `{run.get('command', '?')}` (budget {run.get('budget_s', '?')} s)", ""]  # fmt: skip
    return lines


def section_steps(run: dict) -> list[str]:
    rows = [[s["name"], s["status"], s.get("exit"), None if s.get("seconds") is None else round(s["seconds"]),
             s.get("limit_s")] for s in run.get("steps", [])]  # fmt: skip
    return ["### Steps", "", *table(["step", "status", "exit", "seconds", "limit (s)"], rows)]


def section_tests(out: Path) -> list[str]:
    lines = ["### Tests and sanitizer", ""]
    for line in log_lines(out / "tests.log", r"^== .*: (exit|TIMEOUT|not run)|(passed|failed|error|selected|"
                                             r"collected|deselected).* in [0-9.]+s|^STATUS"):  # fmt: skip
        lines.append(f"- tests: {line}")
    for line in log_lines(out / "tests.log", r"ERROR SUMMARY|^STATUS|MISMATCH|not found"):
        lines.append(f"- compute-sanitizer memcheck: {line}")
    return [*lines, ""]


def us(ms):
    """Milliseconds as microseconds for a table; a "capture failed: ..." string as its first words (the whole
    message is in the JSON)."""
    if isinstance(ms, str):
        return ms.split(":")[0]
    return None if ms is None else 1e3 * ms


GRAPH_NOTE = ("\"graph us\": the GPU's work per call from CUDA graph replays over copies of the inputs (what a call "
              "costs inside the engine's graphs; bench.gpu_steps.graph_timing), GB/s and % of copy from it; \"launch "
              "us\" = do_bench - graph, the host's launch and planning per call.")


def section_kernels(kernels: dict) -> list[str]:
    if "attention" not in kernels:
        return ["### Kernels", "", "no kernel microbenchmarks (the kernels step failed or was not selected)", ""]
    copy = kernels.get("copy") or {}
    lines = ["### Kernels", "",
             f"bf16; device-to-device copy {fmt(copy.get('copy_GBps'), 0)} GB/s (read + write, {copy.get('buffer_mb')} "
             f"MiB, {copy.get('timer')}){' - ' + copy['note'] if copy.get('note') else ''}. Kernel times: "
             f"{kernels.get('timer')}. GB/s = compulsory bytes (K and V once, q and out once) / time; SDPA gets the "
             "same K/V contiguous (enable_gqa); \"SDPA backend\" is the one that ran under torch's default selection "
             "(its aten op in torch.profiler), \"can run\" the backends that accept the shape when forced. "
             + GRAPH_NOTE, ""]  # fmt: skip
    rows = [[r["model"], r["batch"], r["ctx"], r["q_len"], us(r.get("triton_graph_ms")), r.get("triton_graph_GBps"),
             r.get("triton_graph_pct_copy"), r.get("triton_ms"), us(r.get("triton_launch_overhead_ms")),
             us(r.get("sdpa_graph_ms")), r.get("sdpa_ms"), r.get("sdpa_backend"),
             "/".join(r.get("sdpa_supported") or []) or None, r.get("graph_triton_over_sdpa")]
            for r in kernels.get("attention", [])]  # fmt: skip
    lines += table(["model", "batch", "ctx", "q_len", "Triton graph us", "GB/s (graph)", "% of copy", "Triton ms "
                    "(do_bench)", "launch us", "SDPA graph us", "SDPA ms (do_bench)", "SDPA backend", "can run",
                    "SDPA / Triton (graph)"], rows)  # fmt: skip
    rows = [[r["op"], r["batch"], r["vocab"], us(r.get("triton_graph_ms")), r.get("triton_graph_GBps"),
             r.get("triton_graph_pct_copy"), r.get("triton_ms"), us(r.get("triton_launch_overhead_ms")),
             us(r.get("torch_graph_ms")), r.get("torch_ms")] for r in kernels.get("sampling", [])]  # fmt: skip
    lines += table(["op", "batch", "vocab", "Triton graph us", "GB/s (graph)", "% of copy", "Triton ms (do_bench)",
                    "launch us", "torch graph us", "torch ms (do_bench)"], rows)  # fmt: skip
    rows = [[r["batch"], r["k"], r["vocab"], us(r.get("verify_fused_graph_ms")), r.get("verify_fused_graph_GBps"),
             r.get("verify_fused_graph_pct_copy"), r.get("verify_fused_ms"),
             us(r.get("verify_fused_launch_overhead_ms")), r.get("verify_torch_ms"), r.get("verify_speedup"),
             r.get("full_speedup")] for r in kernels.get("spec_sample", [])]  # fmt: skip
    lines += table(["spec_sample batch", "k", "vocab", "fused graph us", "GB/s (graph)", "% of copy",
                    "fused ms (do_bench)", "launch us", "torch ms", "verify speedup (do_bench)",
                    "with standardization"], rows)  # fmt: skip
    return lines


def section_quant(quant: dict) -> list[str]:
    if not quant:
        return []
    copy = quant.get("copy") or {}
    lines = ["### Quantized linears (weight-only int8 / int4 g32)", "",
             f"Kernel vs bf16 `F.linear` (cuBLAS); GB/s = the weight's own bytes (int8 1 B, int4 0.5 B + fp32 "
             f"scales/offsets per 32, bf16 2 B) / the graph time, copy {fmt(copy.get('copy_GBps'), 0)} GB/s; "
             "x / bf16 = bf16 graph time / x graph time; do_bench: " + str(quant.get("timer")) + ", per Python call; "
             "err = max |kernel - torch reference| / max |reference|. " + GRAPH_NOTE, ""]  # fmt: skip
    schemes = ("bf16", "int8", "int4")
    rows = [[r["model"], r["linear"], f"{r['N']}x{r['K']}", r["rows"],
             *(us(r.get(f"{s}_graph_ms")) for s in schemes), *(r.get(f"{s}_graph_GBps") for s in schemes),
             r.get("int8_graph_speedup_vs_bf16"), r.get("int4_graph_speedup_vs_bf16"),
             " / ".join(fmt(r.get(f"{s}_ms")) for s in schemes),
             " / ".join(fmt(us(r.get(f"{s}_launch_overhead_ms")), 1) for s in schemes),
             r.get("int8_rel_err"), r.get("int4_rel_err")] for r in quant.get("kernel", [])]  # fmt: skip
    lines += table(["model", "linear", "N x K", "rows", "bf16 graph us", "int8 graph us", "int4 graph us",
                    "bf16 GB/s", "int8 GB/s", "int4 GB/s", "int8 / bf16", "int4 / bf16", "do_bench ms bf16 / int8 / "
                    "int4", "launch us bf16 / int8 / int4", "int8 err", "int4 err"], rows)  # fmt: skip
    rows = [[r["model"], r["batch"], r["reps"], r.get("bf16_tok_s"), r.get("int8_tok_s"), r.get("int8_speedup"),
             r.get("int8_same_tokens_as_bf16"), r.get("int4_tok_s"), r.get("int4_speedup"),
             r.get("int4_same_tokens_as_bf16")] for r in quant.get("plain", [])]  # fmt: skip
    if rows:
        lines += ["Plain decoding, random-weight targets (bf16 checkpoint), 128-id prompts, 64 new tokens, median of "
                  "the reps after a warm-up:", ""]
        lines += table(["model", "batch", "reps", "bf16 tok/s", "int8 tok/s", "int8 / bf16", "int8 same tokens",
                        "int4 tok/s", "int4 / bf16", "int4 same tokens"], rows)  # fmt: skip
    rows = [[r["model"], r["batch"], r["reps"], r.get("plain_tok_s"), r.get("spec_tok_s"), r.get("speedup"),
             r.get("acceptance"), r.get("greedy_identical")] for r in quant.get("self_draft", [])]  # fmt: skip
    if rows:
        lines += ["Speculative decoding drafted by the target's own int4 copy (k = 4, greedy; random weights: the "
                  "acceptance is a floor):", ""]
        lines += table(["model", "batch", "reps", "plain bf16 tok/s", "spec tok/s", "speedup", "acceptance",
                        "greedy identical"], rows)  # fmt: skip
    return lines


def _shares(share: dict | None) -> str:
    """The draft's weight bytes over the target's, full LM head / reduced draft vocabulary ("-": older files)."""
    return "-" if not share else f"{share['full_vocab']:.3f} / {share['draft_vocab']:.3f}"


def section_e2e(e2e: dict) -> list[str]:
    if not e2e:
        return ["### End to end", "", "no e2e.json (the step failed or was not selected)", ""]
    pairs = e2e.get("pairs", {})
    rows_all = [r for entry in pairs.values() for r in entry.get("batches", {}).values()]
    checked = sum(r.get("requests_checked", 0) for r in rows_all)
    lines = ["### End to end", ""]
    if e2e.get("failure"):
        lines += [f"**FAILED: {e2e['failure']}** (the step stops at the first run with a request that ended in error "
                  "or short of its length; the rows below are the runs before it)", ""]  # fmt: skip
    if "warm_up" not in e2e:  # an e2e.json from before the warm-up / checks / graph-path costs (the first H200 run)
        lines += [f"An older e2e.json (draft_model, k={e2e.get('k')}, {e2e.get('max_tokens')} new tokens, median of "
                  f"{e2e.get('reps')} runs): its warm-up, prefix caching, request checks and costs were those of the "
                  "code that wrote it, not the ones described in docs/results.md now; no `path` means c and v(k) "
                  "were timed through a fresh eager runner.", ""]  # fmt: skip
    else:
        tokens, complete = e2e.get("max_tokens"), "" if e2e.get("failure") else ", all complete"
        lines += [f"draft_model, k={e2e.get('k')}, greedy, {e2e.get('dtype')}, prompts of {e2e.get('prompt_len')} "
                  f"random ids, {tokens} new tokens (ignore_eos); per batch a warm-up run of each engine identical to "
                  "the timed ones (every CUDA-graph bucket they use captured before timing), then the median of "
                  f"{e2e.get('reps')} interleaved runs (an odd count: the median is one run's time; `reps` column); "
                  f"prefix caching {'on' if e2e.get('prefix_caching', True) else 'off'}; tok/s = generated tokens / "
                  "wall time of generate (prefill included). Every request of every run checked - no error, "
                  f"finish_reason length, all {tokens} tokens: {checked} timed requests checked{complete}. c and v(k) "
                  "through the speculative engine's own runners (`path`: their static forward, CUDA graphs on CUDA, as "
                  "the engine runs them); the eager columns time a fresh eager runner, as the first GPU run did. Pairs "
                  "(in run order): `damped` = 1B-shaped target whose layers >= 2 are damped, draft = its first 2 "
                  "layers (known acceptance); `random` = 3B-shaped target, independent 1B-shaped draft (they do not "
                  "agree: costs only).", ""]  # fmt: skip
    if e2e.get("not_run"):
        lines += [f"Not run (out of time): {', '.join(e2e['not_run'])}.", ""]
    rows = []
    for name, entry in pairs.items():
        for batch, r in entry.get("batches", {}).items():
            c, ce, cv = r.get("costs", {}), r.get("costs_eager", {}), r.get("costs_draft_vocab", {})
            rows.append([name, batch, r.get("reps"), r.get("plain_tokens_per_s"), r.get("spec_tokens_per_s"),
                         r.get("speedup"), r.get("acceptance_rate"), r.get("alpha"), r.get("tau"), c.get("c"),
                         cv.get("c"), _shares(r.get("byte_share")), c.get("v_k"), c.get("target_1_ms"),
                         (c.get("path") or {}).get("target"),
                         ce.get("c"), ce.get("v_k"), ce.get("target_1_ms"), r.get("identical_tokens"),
                         r.get("requests_checked")])  # fmt: skip
        if entry.get("stopped_early"):
            lines += [f"`{name}` stopped early ({entry['stopped_early']}): out of time.", ""]
    lines += table(["pair", "batch", "reps", "plain tok/s", "spec tok/s", "speedup", "accept", "alpha", "tau", "c",
                    "c (reduced draft vocab)", "draft bytes / target (full, reduced vocab)", "v(k)",
                    "target decode ms", "path", "c (eager)", "v(k) (eager)",
                    "eager decode ms", "greedy identical (bf16)", "requests checked"], rows)  # fmt: skip
    static_rows = []
    for name, entry in pairs.items():
        for batch, r in entry.get("batches", {}).items():
            for engine, by_runner in (r.get("static", {}).get("timed") or {}).items():
                for runner, d in by_runner.items():
                    static_rows.append([name, batch, engine, runner, d.get("mode"), d.get("forwards"),
                                        d.get("replays"), d.get("loop_steps", "-"), d.get("fallbacks"),
                                        d.get("eager_forwards"), d.get("buckets"), d.get("note")])  # fmt: skip
    if static_rows:
        lines += ["Static forwards during the timed runs, every runner (`buckets captured` > 0 would mean a capture "
                  "inside a timed run; `eager` forwards are prefill and ragged or mixed batches; `draft loop steps`: "
                  "the draft's pure steps as one program per round, specdec/runner/draft_loop.py):", ""]  # fmt: skip
        lines += table(["pair", "batch", "engine", "runner", "mode", "forwards", "replays", "draft loop steps",
                        "fallbacks", "eager",
                        "buckets captured", "note"], static_rows)  # fmt: skip
    graphs = pairs.get("random", {}).get("graphs_vs_eager")
    if graphs:
        lines += ["CUDA graphs vs `enforce_eager=True`, plain decoding of the random target (medians; static forwards "
                  "of the graphs engine's target runner during the timed runs):", ""]  # fmt: skip
        rows = []
        for b, r in graphs.items():
            if not isinstance(r, dict):
                continue
            g = (r.get("static_timed") or {}).get("graphs", {}).get("target", {})
            rows.append([b, r.get("reps"), r["eager_tokens_per_s"], r["graphs_tokens_per_s"], r["speedup"],
                         r["identical_tokens"], g.get("mode"), g.get("replays"), g.get("fallbacks"),
                         g.get("buckets")])  # fmt: skip
        lines += table(["batch", "reps", "eager tok/s", "graphs tok/s", "speedup", "identical tokens", "mode",
                        "replays", "fallbacks", "buckets captured"], rows)  # fmt: skip
    fp32 = e2e.get("fp32_greedy_identity")
    if fp32:
        lines += [f"fp32 greedy identity (small pair, {fp32['tokens_per_request']} tokens): {fp32['identical']}/"
                  f"{fp32['requests']} requests identical to plain greedy (acceptance {fmt(fp32['acceptance_rate'])}).",
                  ""]  # fmt: skip
    profile = e2e.get("profile")
    if profile:
        from bench.gpu_steps.e2e import PROFILE_EVENTS

        counts = profile.get("counts") or {}
        if "event_counts" in profile:  # the older rule: names by prefix (cudaMemcpy* included async copies)
            lines += [f"Profile of one speculative round ({profile['pair']} pair, batch {profile['batch']}), counted "
                      "by the older rule (every event whose name starts with the key, the bench's own closing "
                      "synchronize included): " + ", ".join(f"{k} x{v}" for k, v in profile["event_counts"].items()),
                      ""]  # fmt: skip
        if counts:
            lines += [f"Profile of one speculative round ({profile['pair']} pair, batch {profile['batch']}; events "
                      f"inside {profile.get('window', '?')}; top ops in profile.txt): {profile.get('host_waits', '?')} "
                      "host waits - " + ", ".join(f"{PROFILE_EVENTS.get(k, k)} x{v}" for k, v in counts.items()),
                      ""]  # fmt: skip
    return lines


def section_projection(e2e: dict, alphas: list[float]) -> list[str]:
    from bench.speed.e2e import improvement

    k = e2e.get("k", 4)
    lines = ["### Projection", "",
             f"Predicted speedup = `bench.speed.e2e.improvement(alpha, k={k}, c, v(k))` = (1 - a^(k+1)) / "
             "((1 - a)(k c + v(k))) (Theorem 3.8 with the measured verification cost, the \"Thm+v(k)\" column of "
             "`bench.speed.e2e`), from the c and v(k) measured above through the engine's runners (`path`), at "
             "assumed acceptances and at the measured one, beside the measured speedup.", ""]  # fmt: skip
    rows = []
    for name, entry in e2e.get("pairs", {}).items():
        for batch, r in entry.get("batches", {}).items():
            c, v = r["costs"]["c"], r["costs"]["v_k"]
            rows.append([name, batch, c, v, *(improvement(a, k, c, v) for a in alphas), r.get("alpha"),
                         improvement(r.get("alpha"), k, c, v), r.get("speedup")])  # fmt: skip
    header = ["pair", "batch", "c", "v(k)", *(f"alpha {a:g}" for a in alphas), "measured alpha", "at measured alpha",
              "measured speedup"]  # fmt: skip
    return [*lines, *table(header, rows), *section_cpu_acceptance(e2e)]


def section_cpu_acceptance(e2e: dict) -> list[str]:
    """``bench.projection.speculative``'s table with this run's c and v(k): the real-weight acceptance measured on CPU
    (bench/results), projected onto this GPU."""
    from bench.projection import speculative as projection

    gpu = projection.gpu_costs(e2e)
    if gpu is None:
        return []
    rows = [row for path in projection.DEFAULT_RESULTS if path.exists()
            for row in projection.project(path, lambda meta, k: gpu if meta.get("draft") else {**gpu, "c": 0.0})]
    return ["#### Real-weight acceptance measured on CPU, projected with these c and v(k) "
            "(`bench.projection.speculative`)", "",
            projection.markdown(rows), ""]


def main(argv: list[str] | None = None) -> int:
    def extra(parser):
        parser.add_argument("--alpha", type=float, nargs="+", default=[0.6, 0.7, 0.8])

    args = parse_args(__doc__.splitlines()[0], argv, extra)
    env = load(args.out / "env.json")
    run = env.get("run", {})
    e2e = load(args.out / "e2e.json")
    kernels = load(args.out / "kernels.json")
    lines = [*section_env(env, run), *section_steps(run), *section_tests(args.out), *section_kernels(kernels),
             *section_quant(load(args.out / "quant.json")),
             *section_breakdown(kernels.get("breakdown"), table, fmt), *section_e2e(e2e)]  # fmt: skip
    if e2e.get("pairs"):
        lines += section_projection(e2e, args.alpha)
    lines += section_real(load(args.out / "real.json"), table, fmt)
    (args.out / "summary.md").write_text("\n".join(lines).rstrip() + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
