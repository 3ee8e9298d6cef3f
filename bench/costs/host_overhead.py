"""The engine's own time per step, with a negligible model (1 layer, hidden 64): the floor no GPU can go below.

Whatever a step costs here is host work - scheduling, metadata, sampling over the vocabulary, drafting
bookkeeping, verification - because the forward itself is a few tiny matrix products. Rows: plain decoding and
draft-model speculation (k=4, the draft a copy of the target, so every draft is accepted), greedy and sampled
(T=0.8), at batch 1/8/64 and vocab 512 / 128256 by default. Configurations are interleaved and each figure is
the median over repetitions, so a noisy neighbour shifts all of them alike.

``--penalties`` gives every request repetition / presence / frequency penalties (1.1 / 0.5 / 0.3), so the rows
include the penalty context; ``--prompt-len`` sets the prompt length (16 by default; long prompts show the cost of
a request's history per step).

    python -m bench.costs.host_overhead [--vocab 512 128256] [--batch 1 8 64] [--steps 20] [--reps 3] [--threads 1]
                                  [--penalties] [--prompt-len 16]
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
import time
from pathlib import Path

import torch

from bench.common import add_record_flag, machine_info, median, print_table, set_threads, warm_up_sampling, write_json

MODES = {  # name -> (speculative?, temperature)
    "plain greedy": (False, 0.0),
    "plain T=0.8": (False, 0.8),
    "draft k=4 greedy": (True, 0.0),
    "draft k=4 T=0.8": (True, 0.8),
}
K = 4
PENALTIES = {"repetition_penalty": 1.1, "presence_penalty": 0.5, "frequency_penalty": 0.3}  # --penalties
MAX_POSITIONS = 4096  # the negligible model's max_position_embeddings
POW2_WIDTHS = tuple(2**i for i in range(12))  # --static: block-table widths (the CPU attention gathers the width)


def make_negligible_model(path: str, vocab: int) -> None:
    """A 1-layer, hidden-64 llama with ``vocab`` tokens (no tokenizer: prompts are token ids)."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests"))
    from tiny_models import make_tiny_model

    make_tiny_model(path, "llama", seed=0, vocab_size=vocab, hidden_size=64, num_layers=1, num_heads=4,
                    num_kv_heads=2, intermediate_size=128, with_tokenizer=False, max_position_embeddings=MAX_POSITIONS)


def max_model_len(prompt_len: int, steps: int) -> int:
    """Room for the prompt and every timed step (at least 2048, the default runs' length)."""
    need = prompt_len + (steps + 3) * (K + 1) + 8
    if prompt_len < 1:
        raise ValueError(f"--prompt-len must be >= 1, got {prompt_len}")
    if need > MAX_POSITIONS:
        raise ValueError(f"--prompt-len {prompt_len} with --steps {steps} needs {need} positions; the model has "
                         f"{MAX_POSITIONS}")
    return max(2048, need)


def build_engines(path: str, batch: int, model_len: int = 2048, modes: list[str] | None = None,
                  static: str | None = None) -> dict:
    """One engine per mode (``modes``, default all); with ``static``, a twin of each whose uniform batches run
    through the static forward in that mode ("eager" / "compile": LLMEngine.enable_static_forward, block-table
    widths bucketed by powers of two), named "<mode> [static <static>]"."""
    import specdec

    engines = {}
    for name in modes or list(MODES):
        speculative = MODES[name][0]
        spec = specdec.SpeculativeConfig(method="draft_model", draft_model=path, num_speculative_tokens=K) \
            if speculative else None
        for twin in [None] + ([static] if static else []):
            llm = specdec.LLM(path, dtype="float32", max_model_len=model_len, max_num_seqs=max(batch, 1),
                              num_kv_blocks=(batch + 1) * model_len // 16 + 8, speculative=spec,
                              prepack_weights=False if twin == "compile" else None)  # compile traces F.linear
            if twin is not None:
                llm.engine.enable_static_forward(twin, block_buckets=POW2_WIDTHS)
            engines[name if twin is None else f"{name} [static {twin}]"] = llm.engine
    return engines


def seconds_per_step(engine, batch: int, temperature: float, steps: int, vocab: int, penalties: bool = False,
                     prompt_len: int = 16) -> float:
    """Median wall time of ``steps`` engine steps with ``batch`` requests all decoding (prefill excluded)."""
    from specdec import SamplingParams

    params = SamplingParams(temperature=temperature, max_tokens=steps * (K + 1) + 8, ignore_eos=True, seed=1,
                            **(PENALTIES if penalties else {}))
    ids = [engine.add_request(prompt_token_ids=[(7 * i + j) % vocab for j in range(prompt_len)], params=params)
           for i in range(batch)]
    pending = list(engine.scheduler.running) + list(engine.scheduler.waiting)
    while any(s.num_computed < s.num_tokens - 1 for s in pending):
        engine.step()  # prefill (in chunks, for long prompts)
    engine.step()  # one step to reach steady state
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - start)
    for rid in ids:
        engine.abort(rid)
    engine.step()  # flush the abort outputs
    return median(times)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--vocab", type=int, nargs="+", default=[512, 128256], help="vocabulary sizes")
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 8, 64], help="requests decoding together")
    parser.add_argument("--steps", type=int, default=20, help="timed steps per configuration and repetition")
    parser.add_argument("--reps", type=int, default=3, help="interleaved repetitions (the median is reported)")
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    parser.add_argument("--penalties", action="store_true",
                        help="repetition / presence / frequency penalties 1.1 / 0.5 / 0.3 on every request")
    parser.add_argument("--prompt-len", type=int, default=16, help="prompt tokens per request")
    parser.add_argument("--modes", nargs="+", choices=list(MODES), help="modes to time (default: all)")
    parser.add_argument("--static", choices=["eager", "compile"],
                        help="also time each mode with uniform batches through the static forward in this mode "
                             "(compile: torch.compile per bucket, done in the untimed warm-up step)")
    add_record_flag(parser)
    args = parser.parse_args(argv)
    set_threads(args.threads)
    warm_up_sampling()
    model_len = max_model_len(args.prompt_len, args.steps)
    rows, results = [], []
    for vocab in args.vocab:
        folder = tempfile.mkdtemp(prefix=f"host_overhead_v{vocab}_")
        try:
            make_negligible_model(folder, vocab)
            for batch in args.batch:
                engines = build_engines(folder, batch, model_len, args.modes, args.static)
                samples: dict[str, list[float]] = {name: [] for name in engines}
                for _ in range(args.reps):  # interleaved A/B/C/D
                    for name, engine in engines.items():
                        temperature = MODES[name.split(" [")[0]][1]
                        samples[name].append(seconds_per_step(engine, batch, temperature, args.steps, vocab,
                                                              args.penalties, args.prompt_len))
                for name in engines:
                    ms = 1e3 * median(samples[name])
                    results.append({"vocab": vocab, "batch": batch, "mode": name, "ms_per_step": ms,
                                    "samples_ms": [1e3 * s for s in samples[name]]})
                    rows.append([vocab, batch, name, f"{ms:.2f}"])
        finally:
            shutil.rmtree(folder, ignore_errors=True)
    print_table(rows, ["vocab", "batch", "mode", "ms/step (speculative: per round)"])
    suffix = ("_penalties" if args.penalties else "") + (f"_p{args.prompt_len}" if args.prompt_len != 16 else "") \
        + (f"_static_{args.static}" if args.static else "")
    path = write_json(f"host_overhead_t{args.threads}{suffix}",
                      {"machine": machine_info(), "threads": torch.get_num_threads(), "k": K, "steps": args.steps,
                       "reps": args.reps, "penalties": PENALTIES if args.penalties else None,
                       "prompt_len": args.prompt_len, "static": args.static, "results": results}, record=args.record)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
