"""summary.md's section for the real step (real.json): SmolLM2-135M, plain vs prompt lookup vs n-gram drafting per
batch, temperature and prompt class, each measured speedup beside its two predictions. ``table`` and ``fmt`` are
summary.py's (passed in, so this module imports nothing of it)."""

from __future__ import annotations

HEADER = ["batch", "T", "class", "drafter", "reps", "plain tok/s", "spec tok/s", "speedup", "accept", "tau", "f",
          "drafting ms/step", "c", "v(k)", "predicted (Thm+v(k))", "predicted (mix)", "greedy identical"]  # fmt: skip


def rows(real: dict) -> list[list]:
    """One row per (batch, temperature, class, drafter), in run order."""
    out = []
    for group in real.get("groups", []):
        for method, r in group["methods"].items():
            out.append([group["batch"], f"{group['temperature']:g}", group["class"], method, group["reps"],
                        group["plain"]["tokens_per_s"], r["tokens_per_s"], r["speedup"], r["acceptance_rate"],
                        r["tau"], r["speculating_step_fraction"], r["propose_ms_per_call"],
                        None if r["c"] is None else f"{r['c']:.4f}",
                        group["costs"]["v_k"], r["predicted_thm_v_k"], r["predicted_mix"],
                        r["identical_to_plain"]])  # fmt: skip
    return out


def section_real(real: dict, table, fmt) -> list[str]:
    if not real:
        return []
    title = "### Real weights: SmolLM2-135M-Instruct, model-free drafters (`real`)"
    if real.get("skipped"):
        return [title, "", f"Skipped: {real['skipped']}", ""]
    model = real.get("model") or {}
    what = (f"GGUF sha256 {model.get('sha256', '?')[:16]}..." if model.get("kind") == "gguf"
            else model.get("kind", "?"))  # fmt: skip
    lines = [title, "",
             f"{what}, {real.get('dtype')}, k={real.get('k')} chains, {real.get('max_tokens')} new tokens "
             f"(ignore_eos), prefix caching off; per row a warm-up run of each engine on the timed prompts, then "
             f"the median of {real.get('reps')} interleaved runs (plain, prompt_lookup, ngram_table); batch B "
             "cycles the class's prompt files (batch 1: the first). f = share of decode steps that verified a draft "
             "(no match: a plain step); c = the drafter's measured host time per decode step (`propose`, the whole "
             "batch) / (k target decodes); v(k) through the engine's target runner (CUDA graphs on CUDA) at the "
             "class's context. Predicted: Theorem 3.8 with v(k) (`bench.speed.e2e.improvement`, every step drafting "
             "k) and the round mix (`bench.speed.e2e.round_mix`, the measured f, tau and draft length: the one that "
             "fits a model-free "
             "drafter).",
             ""]  # fmt: skip
    if real.get("failure"):
        lines += [f"**FAILED: {real['failure']}** (the rows below are the groups measured before it)", ""]
    if real.get("stopped_early"):
        lines += [f"Stopped early ({real['stopped_early']}): out of time.", ""]
    return [*lines, *table(HEADER, rows(real))]
