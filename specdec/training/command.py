"""``specdec train-draft TARGET OUT/``: its options (each field of :class:`TrainDraftConfig`) and the command."""

from __future__ import annotations

import argparse
import json


def add_parser(sub, formatter_class) -> None:
    """Register ``train-draft`` on the CLI's subparsers."""
    p = sub.add_parser("train-draft", help="train an EAGLE-3 head for a target (published layout)",
                       formatter_class=formatter_class,
                       description="Train an EAGLE-3 draft head on the target's own answers to prompts "
                                   "(docs/eagle3.md, 'Training a head'); OUT/ gets the head in the published "
                                   "LlamaForCausalLMEagle3 layout, resumable data and checkpoints.")
    p.add_argument("target", help="the target model folder (or .gguf file / hub id, as LLM(model=))")
    p.add_argument("out_dir", help="where to write the data, checkpoints and the head")
    src = p.add_mutually_exclusive_group()
    src.add_argument("--prompts", default=None, help="prompt file: JSON lines {\"prompt\": ...} or one per line "
                                                    "(default: the shipped set, specdec/training/prompts.jsonl)")
    src.add_argument("--self-prompts", type=int, default=None, metavar="N",
                     help="N prompts written by the target from its chat template's empty user turn")
    p.add_argument("--max-prompts", type=int, default=None, help="use only the first N prompts")
    p.add_argument("--max-new-tokens", type=int, default=128, help="tokens of each target answer")
    p.add_argument("--temperature", type=float, default=0.0, help="of the target's answers; 0 = greedy")
    p.add_argument("--draft-vocab-size", type=int, default=None,
                   help="D, the draft vocabulary: the D most frequent answer tokens (default: min(V, 32000))")
    p.add_argument("--ttt-steps", type=int, default=5, help="draft steps unrolled by the training-time test")
    p.add_argument("--epochs", type=float, default=1.0, help="passes over the data")
    p.add_argument("--steps", type=int, default=None, help="optimizer steps in all (overrides --epochs)")
    p.add_argument("--batch-size", type=int, default=4, help="samples per step")
    p.add_argument("--lr", type=float, default=5e-4, help="peak AdamW learning rate (warmup, then cosine)")
    p.add_argument("--checkpoint-every", type=int, default=100, help="steps between checkpoints")
    p.add_argument("--dtype", default="auto", help="the target's dtype, as LLM(dtype=); the head trains in fp32")
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"), help="where the target and head run")
    p.add_argument("--no-prepack", dest="prepack_weights", action="store_false", default=None,
                   help="as LLM(prepack_weights=False): plain weights and F.linear instead of the prepacked copies")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's choice)")
    p.add_argument("--resume", action="store_true", help="continue from OUT/checkpoints' latest checkpoint")
    p.add_argument("--seed", type=int, default=0, help="seed of the data order, init and sampled answers")


def run(args: argparse.Namespace) -> int:
    from specdec.training import TrainDraftConfig, train_draft

    fields = ("target", "out_dir", "prompts", "self_prompts", "max_prompts", "max_new_tokens", "temperature",
              "draft_vocab_size", "ttt_steps", "epochs", "steps", "batch_size", "lr", "checkpoint_every", "dtype",
              "device", "threads", "resume", "seed", "prepack_weights")
    summary = train_draft(TrainDraftConfig(**{f: getattr(args, f) for f in fields}))
    print(json.dumps({k: v for k, v in summary.items() if k != "config"}, indent=2))
    print(f"wrote the head to {args.out_dir}")
    return 0
