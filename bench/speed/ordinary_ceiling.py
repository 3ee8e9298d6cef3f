"""The ceiling each drafter's measured acceptance allows on the ordinary prompts: tau / v(w).

    python -m bench.speed.ordinary_ceiling RUN.json TREE_COST.json [--record]

RUN.json: a ``bench.speed.ordinary`` run (per kind and configuration: tau, the tokens per verification round, and
the measured speedup over plain). TREE_COST.json: a ``bench.costs.tree_cost`` run on the same model, dtype and
threads (v(w): a w-token window's forward over a one-token decode's, batch 1).

A round drafts, then verifies w = k + 1 tokens (a chain of k; a tree of n nodes: n + 1) and keeps tau of them, so
decoding can at best run tau / v(w) times faster than plain decoding - the drafter's own time and the host's work
per round taken as free, and the prefill (the same for both) left out. That is the ceiling the measured acceptance
allows; "needed" is the tau that would reach 2.0x at that width (2 v(w)). v(w) between measured widths is
interpolated linearly (and beyond the widest from the last two). The width is the configured one: adaptive k
drafts shorter where acceptance is low. tau counts verification rounds only: a decode step where the drafter had
nothing to propose is a plain step (tau 1, cost 1); where the run recorded the share f of steps that verified a
draft (``speculating_step_fraction``), the ceiling over all steps, (f tau + 1 - f) / (f v(w) + 1 - f), is given
too.
"""

from __future__ import annotations

import argparse
import json
import math

from bench.common import add_record_flag, print_table, write_json

GOAL = 2.0


def window_width(config: dict) -> int:
    """Tokens verified per round at the configured size: a tree's budget + 1, else k + 1."""
    if config.get("tree_budget") is not None:
        return int(config["tree_budget"]) + 1
    if config.get("method") == "recycle":  # recycle drafts a tree of 16 nodes by default (proposers/recycle.py)
        return 17
    return int(config["num_speculative_tokens"]) + 1


def interpolate(widths: list[int], costs: list[float], w: int) -> float:
    """v(w) from measured (width, v) points, linear between them and beyond the widest (from the last two)."""
    points = sorted(zip(widths, costs))
    if w <= points[0][0]:
        return points[0][1]
    for (w0, v0), (w1, v1) in zip(points, points[1:]):
        if w <= w1:
            return v0 + (v1 - v0) * (w - w0) / (w1 - w0)
    (w0, v0), (w1, v1) = points[-2:]
    return v1 + (v1 - v0) * (w - w1) / (w1 - w0)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.speed.ordinary_ceiling",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("run")
    parser.add_argument("tree_cost")
    add_record_flag(parser)
    args = parser.parse_args(argv)
    run, cost = json.load(open(args.run)), json.load(open(args.tree_cost))
    measured = [r for r in cost["results"] if r["batch"] == 1]
    widths, costs = [r["width"] for r in measured], [r["v"] for r in measured]
    rows, results = [], []
    for kind, per_config in run["results"].items():
        if kind == "all":
            continue
        for name, r in per_config.items():
            if name == "plain":
                continue
            w = window_width(run["configs"][name])
            v = interpolate(widths, costs, w)
            ceiling = r["tau"] / v
            f = r.get("speculating_step_fraction")
            all_steps = (f * r["tau"] + 1 - f) / (f * v + 1 - f) if f is not None else None
            rows.append([kind, name, w, f"{v:.2f}", f"{r['tau']:.2f}", f"{ceiling:.2f}x",
                         "-" if f is None else f"{f:.2f}", "-" if all_steps is None else f"{all_steps:.2f}x",
                         f"{r['speedup']:.2f}x", f"{GOAL * v:.2f}"])
            results.append({"kind": kind, "config": name, "width": w, "v": v, "tau": r["tau"], "ceiling": ceiling,
                            "speculating_step_fraction": f, "ceiling_all_steps": all_steps,
                            "measured_speedup": r["speedup"], "tau_needed_for_goal": GOAL * v})
    print_table(rows, ["kind", "config", "w", "v(w)", "tau", "ceiling tau/v", "f", "over all steps", "measured",
                       f"tau for {GOAL}x"])
    best = {}
    for r in results:
        best.setdefault(r["config"], []).append(r["ceiling"])
    geomeans = {name: math.exp(sum(map(math.log, cs)) / len(cs)) for name, cs in best.items()}
    print("geometric mean of the ceilings over the kinds:", {k: round(v, 2) for k, v in geomeans.items()})
    payload = {"run": args.run, "tree_cost": args.tree_cost, "v_measured": dict(zip(widths, costs)),
               "results": results, "geomean_ceiling": geomeans, "goal": GOAL}
    print(f"wrote {write_json('ordinary_ceiling', payload, args.record)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
