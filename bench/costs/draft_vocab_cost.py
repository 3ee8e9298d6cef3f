"""A draft step's cost with the full LM head vs a reduced draft vocabulary (``SpeculativeConfig(draft_vocab=)``).

A random-weight draft of a realistic small shape (default: hidden 576, 4 layers, a 128256-id tied vocabulary, fp32;
``bench/gpu_steps/models.py``) is loaded twice - its whole head, and the head cut to a fixed subset of ``--subset``
ids (random weights: any fixed subset will do; a seeded sample spread over the vocabulary, as frequency-ranked ids
are) - and each drafts chains of k tokens for ``--batch`` requests through the real ``DraftModelProposer.propose``:
k one-token forwards (the head included) and k samplings (greedy, or T=0.8 top-p 0.95 with q laid out over the
target's vocabulary). Variants are interleaved (the order rotates per repetition) and each figure is the median
over repetitions; reported per draft step (a round / k).

    python -m bench.costs.draft_vocab_cost [--hidden 576] [--layers 4] [--vocab 128256] [--subset 32000]
                                     [--batch 1 4] [--k 4] [--context 256] [--reps 15] [--threads 1]
                                     [--clock wall|cpu]
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile

import torch

from bench.common import (
    add_record_flag,
    machine_info,
    median,
    print_table,
    set_clock,
    set_threads,
    timed,
    warm_up_sampling,
    write_json,
)
from bench.gpu_steps.models import write_random_llama
from specdec.checkpoint.loader import load_model
from specdec.engine.sequence import Sequence
from specdec.model.config import ModelConfig
from specdec.model.linear import prepack_linears, prepack_supported
from specdec.model.subset_head import restrict_lm_head
from specdec.sampling.params import SamplingParams
from specdec.spec_decode.proposers.draft_model import DraftModelProposer
from specdec.spec_decode.proposers.draft_vocab import DraftVocab

MODES = {"greedy": {"temperature": 0.0}, "T=0.8 top-p 0.95": {"temperature": 0.8, "top_p": 0.95}}
BLOCK = 16
CPU = torch.device("cpu")


def held_bytes(model) -> int:
    """Bytes of every parameter, buffer and packed weight copy the model holds (meta tensors excluded)."""
    tensors = [*model.parameters(), *model.buffers()]
    tensors += [m.packed_copy for m in model.modules() if getattr(m, "packed_copy", None) is not None]
    seen, total = set(), 0
    for t in tensors:
        if t.is_meta or id(t) in seen:
            continue
        seen.add(id(t))
        total += t.numel() * t.element_size()
    return total


def build_proposers(path: str, subset: int, context: int, k: int, batch: int, seed: int = 0
                    ) -> dict[str, DraftModelProposer]:
    """``{"full head": ..., "|S| = N": ...}``: the draft with its whole head and with the head cut to ``subset``
    ids, each with a pool for ``batch`` requests of ``context + k`` tokens."""
    config = ModelConfig.from_json(path)
    positions = context + k + 1
    blocks = len(MODES) * batch * -(-positions // BLOCK) + 1  # each mode's requests have their own
    full = load_model(path, torch.float32, CPU, positions + 1, config)
    cut = load_model(path, torch.float32, CPU, positions + 1, config, prepack_weights=False)
    ids = torch.randperm(config.vocab_size, generator=torch.Generator().manual_seed(seed))[:subset].sort().values
    restrict_lm_head(cut, ids)
    if prepack_supported(torch.float32, CPU):
        prepack_linears(cut)  # as the factory does after cutting
    make = lambda model, vocab: DraftModelProposer(model, config, blocks, BLOCK, torch.float32, CPU,  # noqa: E731
                                                   config.vocab_size, positions, draft_vocab=vocab)
    return {"full head": make(full, None), f"|S| = {subset}": make(cut, DraftVocab(ids, config.vocab_size, CPU))}


def requests(vocab_size: int, batch: int, context: int, mode: str, first_id: int) -> list[Sequence]:
    """``batch`` requests of ``context`` random prompt tokens sampled as ``mode``, seq ids from ``first_id``."""
    gen = torch.Generator().manual_seed(batch)
    return [Sequence(first_id + i, f"r{first_id + i}", None,
                     torch.randint(0, vocab_size, (context,), generator=gen).tolist(),
                     SamplingParams(seed=i, **MODES[mode]), i, frozenset()) for i in range(batch)]


def round_seconds(proposer: DraftModelProposer, seqs: list[Sequence], k: int) -> float:
    """One chain round of k drafts per request, the draft cache reset to the prompt's first n - 1 tokens before
    it (so every round is k one-token forwards: the last prompt token, then k - 1 drafts)."""
    for seq in seqs:
        proposer.discard(seq, seq.num_tokens - 1)
    return timed(lambda: proposer.propose(seqs, [k] * len(seqs)).device_ids.tolist())[0]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--hidden", type=int, default=576, help="hidden size (SmolLM2-135M's)")
    parser.add_argument("--layers", type=int, default=4, help="decoder layers")
    parser.add_argument("--heads", type=int, default=9, help="attention heads")
    parser.add_argument("--kv-heads", type=int, default=3, help="key/value heads")
    parser.add_argument("--intermediate", type=int, default=1536, help="MLP width")
    parser.add_argument("--vocab", type=int, default=128256, help="the vocabulary (Llama 3's)")
    parser.add_argument("--subset", type=int, default=32000, help="ids the reduced head keeps")
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 4], help="requests drafting together")
    parser.add_argument("--k", type=int, default=4, help="drafts per round")
    parser.add_argument("--context", type=int, default=256, help="prompt tokens per request (cached)")
    parser.add_argument("--reps", type=int, default=15, help="interleaved repetitions (the median is reported)")
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    parser.add_argument("--clock", choices=["wall", "cpu"], default="wall",
                        help="wall time, or the process's CPU time (other processes' load does not move it)")
    add_record_flag(parser)
    args = parser.parse_args(argv)
    if not 1 <= args.subset <= args.vocab:
        raise SystemExit(f"--subset must be in [1, {args.vocab}], got {args.subset}")
    set_threads(args.threads)
    set_clock(args.clock)
    warm_up_sampling()
    folder = tempfile.mkdtemp(prefix="draft_vocab_cost_")
    rows, results = [], []
    try:
        write_random_llama(folder, hidden_size=args.hidden, num_layers=args.layers, num_heads=args.heads,
                           num_kv_heads=args.kv_heads, intermediate_size=args.intermediate, vocab_size=args.vocab,
                           dtype=torch.float32, device="cpu", max_position_embeddings=args.context + args.k + 8)
        for batch in args.batch:
            proposers = build_proposers(folder, args.subset, args.context, args.k, batch)
            sizes = {name: held_bytes(p.runner.model) for name, p in proposers.items()}
            cases = [(name, mode) for mode in MODES for name in proposers]
            seqs = {mode: requests(args.vocab, batch, args.context, mode, j * batch) for j, mode in enumerate(MODES)}
            for p in proposers.values():  # the prefill of every request (untimed), then one warm-up round
                for mode in MODES:
                    for s in seqs[mode]:
                        p.block_manager.allocate(s.seq_id, s.num_tokens + args.k)
                    p.propose(seqs[mode], [args.k] * batch)
                    round_seconds(p, seqs[mode], args.k)
            samples: dict[tuple[str, str], list[float]] = {case: [] for case in cases}
            for rep in range(args.reps):  # interleaved, the order rotating
                for name, mode in cases[rep % len(cases):] + cases[: rep % len(cases)]:
                    samples[(name, mode)].append(round_seconds(proposers[name], seqs[mode], args.k))
            for name, mode in cases:
                ms = 1e3 * median(samples[(name, mode)]) / args.k
                full_ms = 1e3 * median(samples[("full head", mode)]) / args.k
                results.append({"batch": batch, "head": name, "mode": mode, "ms_per_draft_step": ms,
                                "speedup_vs_full": full_ms / ms, "weights_mb": sizes[name] / 1e6,
                                "samples_ms_per_round": [1e3 * s for s in samples[(name, mode)]]})
                rows.append([batch, mode, name, f"{ms:.2f}", f"{full_ms / ms:.2f}x", f"{sizes[name] / 1e6:.1f}"])
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    print_table(rows, ["batch", "mode", "head", "ms / draft step", "vs full", "weights MB"])
    path = write_json(f"draft_vocab_cost_v{args.vocab}_s{args.subset}_l{args.layers}_t{args.threads}",
                      {"machine": machine_info(), "args": vars(args), "results": results}, record=args.record)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
