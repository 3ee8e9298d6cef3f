"""summary.md's section for the breakdown step (kernels.json, key "breakdown"): per case the step's GPU time by
kernel group against its memory bound, and the unfused forward, the fused kernels (CUDA graphs) and torch.compile
side by side where they ran."""

from __future__ import annotations

from bench.gpu_steps.kernel_groups import GROUPS


def fmt_group(group: dict) -> str:
    """One group's cell: share of the step, kernels, microseconds."""
    return f"{100 * group['share']:.0f}% ({group['kernels']}, {group['us']:.0f} us)"


def _forward(case: dict) -> str:
    """How the case's forward was built: "unfused", "fused" (kernels, CUDA graphs) or "compiled" (older files: by
    mode)."""
    return case.get("forward") or ("compiled" if case["mode"] == "compile" else "fused")


def _cell(case: dict | None, key: str):
    if case is None:
        return "-"
    return case["steady"]["tok_s"] if key == "tok_s" else case[key]


def compare_rows(cases: list[dict]) -> list[list]:
    """Plain decode per (model, batch): the unfused forward, the fused kernels and mode "compile" where they ran
    (tok/s, ratios to the fused forward, kernels and GPU us of each)."""
    decode: dict[tuple, dict[str, dict]] = {}
    for c in cases:
        if c["step"] == "decode":
            decode.setdefault((c["model"], c["batch"]), {})[_forward(c)] = c
    rows = []
    for (model, batch), by in decode.items():
        fused = by.get("fused")
        if fused is None or len(by) < 2:
            continue
        ratio = [f"{by[f]['steady']['tok_s'] / fused['steady']['tok_s']:.2f}" if f in by else "-"
                 for f in ("unfused", "compiled")]
        rows.append([model, batch, *(_cell(by.get(f), "tok_s") for f in ("unfused", "fused", "compiled")), *ratio,
                     *(_cell(by.get(f), "kernels") for f in ("unfused", "fused", "compiled")),
                     *(_cell(by.get(f), "us") for f in ("unfused", "fused", "compiled")),
                     by["compiled"]["warm_up"]["s"] if "compiled" in by else "-"])  # fmt: skip
    return rows


def section_breakdown(breakdown: dict | None, table, fmt) -> list[str]:
    """The section's lines (``table`` / ``fmt``: summary.py's helpers); nothing without a breakdown."""
    if not breakdown:
        return []
    copy = breakdown.get("copy") or {}
    lines = ["### Per-kernel breakdown of a decode step", "",
             f"{breakdown.get('dtype')}, random weights, prompts of {breakdown.get('prompt_len')} random ids, "
             f"k = {breakdown.get('k')}. Each case: one `engine.step` (its static forward as the engine runs it: "
             "CUDA graph replays on CUDA) under torch.profiler; every device event (kernels, memcpy, memset) "
             "classified by name (`bench.gpu_steps.kernel_groups.classify_kernel`). GPU us = their sum. Bound = "
             "(weights + KV read, per forward of each runner) / the device-to-device copy, "
             f"{fmt(copy.get('copy_GBps'), 0)} GB/s measured in this step. Steady step = median wall time of the "
             "steps before it (replay + host work); tok/s = tokens emitted / their time.", ""]  # fmt: skip
    cases = breakdown.get("cases", [])
    if breakdown.get("failure"):
        lines += [f"**FAILED: {breakdown['failure']}**", ""]
    rows = [[c["model"], c["step"], c["batch"], c["mode"], _forward(c), c["kernels"], c["us"], c["bound_us"],
             c["gpu_over_bound"],
             c["steady"]["step_ms"], c["step_over_bound"], c["steady"]["tok_s"],
             f"{100 * c['outside_gemm_attention']:.0f}%", *(" / ".join(str(d[key]) for d in c["static"].values())
                                                            for key in ("forwards", "replays", "eager_forwards")),
             c["source"]] for c in cases]  # fmt: skip
    lines += table(["model", "step", "batch", "mode", "forward", "kernels", "GPU us", "bound us", "GPU / bound",
                    "steady step ms", "step / bound", "tok/s", "outside GEMM + attention", "forwards (target / "
                    "draft)", "static replays", "eager forwards", "events"], rows)  # fmt: skip
    rows = [[c["model"], c["step"], c["batch"], _forward(c), *(fmt_group(c["groups"][g]) for g in GROUPS)]
            for c in cases]  # fmt: skip
    lines += ["Share of the step's GPU time by group (kernels, us):", ""]
    lines += table(["model", "step", "batch", "forward", *GROUPS], rows)
    rows = compare_rows(cases)
    if rows:
        lines += ["Plain decode: the unfused forward (`ops.fused_forward(False)`, CUDA graphs), the fused kernels "
                  "(CUDA graphs, the engine's default) and mode \"compile\" (torch.compile: Inductor's fusion of the "
                  "references, launched from the host):", ""]  # fmt: skip
        lines += table(["model", "batch", "unfused tok/s", "fused tok/s", "compile tok/s", "unfused / fused",
                        "compile / fused", "unfused kernels", "fused kernels", "compile kernels", "unfused GPU us",
                        "fused GPU us", "compile GPU us", "compile warm-up s"], rows)  # fmt: skip
    notes = [f"compile: {breakdown['compile']}" if breakdown.get("compile") not in (None, "ran") else None,
             f"stopped early: {breakdown['stopped_early']}" if breakdown.get("stopped_early") else None]  # fmt: skip
    lines += [f"- {n}" for n in notes if n]
    return [*lines, ""]
