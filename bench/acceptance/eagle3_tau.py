"""Acceptance of a trained EAGLE-3 head against an untrained one (the same recipe's initial head), per prompt class:
greedy, fp32, k drafted tokens a round; tau = tokens per verification round, the bonus token included.

    python -m bench.acceptance.eagle3_tau smollm2 /work/heads/smollm2-eagle3 --threads 1
    python -m bench.acceptance.eagle3_tau smollm2 HEAD --record      # also write bench/results/eagle3_tau_<target>.json

The untrained head is built like ``train-draft`` builds its starting point (``pipeline.initial_head``: random
``fc`` / ``midlayer``, the target's LM head rows and final norm) with the trained head's config and vocabulary.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time

import torch

from bench.common import PROMPT_CLASSES, RESULTS_DIR, chat_token_ids, load_prompts, resolve_model


def untrained_head(target: str, head_dir: str, out_dir: str, seed: int = 0) -> None:
    """Write the initial head of ``train-draft`` for ``head_dir``'s config and vocabulary into ``out_dir``."""
    import specdec
    from specdec.model.eagle3 import Eagle3Config
    from specdec.training.head import load_train_head
    from specdec.training.pipeline import initial_head
    from specdec.training.writer import write_head

    trained, d2t, t2d = load_train_head(head_dir, max_positions=8)
    with open(f"{head_dir}/config.json", encoding="utf-8") as f:
        raw = json.load(f)
    model = specdec.LLM(target, dtype="float32").engine.model
    draft_ids = torch.arange(d2t.numel()) + d2t
    with torch.no_grad():
        lm_rows, norm = model.lm_head.weight[draft_ids].float(), model.norm.weight.float()
    head = initial_head(Eagle3Config.from_dict(raw), lm_rows, norm, 8, seed)
    write_head(out_dir, raw, head.published_state(), d2t, t2d)
    del trained


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("target", help="alias (smollm2, qwen-1.5b) or model folder")
    parser.add_argument("head", help="the trained head's folder")
    parser.add_argument("--classes", default=",".join(PROMPT_CLASSES))
    parser.add_argument("--per-class", type=int, default=None)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("-k", type=int, default=4, help="draft tokens per round")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--record", action="store_true", help="write bench/results/eagle3_tau_<target>.json")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    import specdec
    from specdec.training.evaluate import acceptance

    target = resolve_model(args.target)
    tokenizer = specdec.LLM(target, dtype="float32").tokenizer
    prompts = load_prompts(args.classes.split(","), args.per_class)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        untrained_head(target, args.head, tmp)
        for cls, items in prompts.items():
            ids = [chat_token_ids(tokenizer, p.text) for p in items]
            row = {"class": cls, "prompts": len(ids)}
            for name, head in (("trained", args.head), ("untrained", tmp)):
                start = time.perf_counter()
                r = acceptance(target, head, ids, max_tokens=args.max_tokens, k=args.k)
                row[name] = {"tau": r["tau"], "acceptance_rate": r["acceptance_rate"], "rounds": r["rounds"],
                             "seconds": time.perf_counter() - start}
            rows.append(row)
            t, u = row["trained"], row["untrained"]
            print(f"{cls:6s} tau trained {t['tau']:.2f} (acceptance {t['acceptance_rate']:.2f})  "
                  f"untrained {u['tau']:.2f} ({u['acceptance_rate']:.2f})", flush=True)
    result = {"target": args.target, "head": args.head, "k": args.k, "max_tokens": args.max_tokens,
              "threads": args.threads, "dtype": "float32", "greedy": True, "rows": rows}
    print(json.dumps(result, indent=2))
    if args.record:
        path = RESULTS_DIR / f"eagle3_tau_{args.target.replace('/', '_')}.json"
        path.write_text(json.dumps(result, indent=2) + "\n")
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
