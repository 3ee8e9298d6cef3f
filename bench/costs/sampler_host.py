"""Host CPU time of the plain sampling layer per step, as the engine's plain step calls it, without the forward.

``sample_rows(logits, params, seeds, positions, contexts)`` with each row's penalty context from the sequence's own
history (``seq.penalty_counts()``), one sampled token appended per row after every step - so a request's history
grows as in decoding. Rows: vocab x batch x temperature (0 / 0.8) x penalties (off / on:
repetition 1.1, presence 0.5, frequency 0.3) x history length (prompt + output, half each). Each figure is the
median thread CPU time (``time.thread_time``: time the process was descheduled on a shared machine is not
counted) over ``--steps`` steps after 2 warm-up steps. The forward, scheduling and the Philox noise's own cost
(kernels/philox.py) are in bench.costs.host_overhead's figures; this isolates what the penalty context and the
per-row settings cost.

    python -m bench.costs.sampler_host [--vocab 512 128256] [--batch 1 8 64] [--history 16 4000] [--steps 15]
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time

import torch

from bench.common import add_record_flag, machine_info, print_table, set_threads, warm_up_sampling, write_json

PENALTIES = {"repetition_penalty": 1.1, "presence_penalty": 0.5, "frequency_penalty": 0.3}


def ms_per_step(vocab: int, batch: int, temperature: float, penalties: bool, history: int, steps: int) -> float:
    from specdec.engine.sequence import Sequence
    from specdec.kernels.philox import STREAM_SAMPLE
    from specdec.sampling.params import SamplingParams
    from specdec.sampling.sampler import sample_rows

    rng = random.Random(0)
    params = SamplingParams(temperature=temperature, seed=1, max_tokens=10**6, **(PENALTIES if penalties else {}))
    seqs = []
    for i in range(batch):
        seq = Sequence(i, str(i), None, [rng.randrange(vocab) for _ in range(max(1, history // 2))], params, i,
                       frozenset())
        for _ in range(history - max(1, history // 2)):
            seq.append_token(rng.randrange(vocab))
        seqs.append(seq)
    logits = torch.randn(batch, vocab, generator=torch.Generator().manual_seed(0))  # fp32 [B, V]
    times = []
    for _ in range(steps + 2):
        start = time.thread_time()
        tokens = sample_rows(logits, [s.params for s in seqs], [s.seed for s in seqs], [s.num_tokens for s in seqs],
                             [s.penalty_counts() if s.params.has_penalties else None for s in seqs], STREAM_SAMPLE,
                             bad_rows=[])[0].tolist()
        times.append(time.thread_time() - start)
        for seq, token in zip(seqs, tokens):
            seq.append_token(token)
    return 1e3 * statistics.median(times[2:])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--vocab", type=int, nargs="+", default=[512, 128256])
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 8, 64])
    parser.add_argument("--history", type=int, nargs="+", default=[16, 4000], help="prompt + output tokens per row")
    parser.add_argument("--steps", type=int, default=15, help="timed steps per configuration")
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    add_record_flag(parser)
    args = parser.parse_args(argv)
    if min(args.history) < 2 or args.steps < 1:
        parser.error("--history must be >= 2 and --steps >= 1")
    set_threads(args.threads)
    warm_up_sampling()
    rows, results = [], []
    for vocab in args.vocab:
        for batch in args.batch:
            for history in args.history:
                for temperature in (0.0, 0.8):
                    for penalties in (False, True):
                        ms = ms_per_step(vocab, batch, temperature, penalties, history, args.steps)
                        results.append({"vocab": vocab, "batch": batch, "history": history,
                                        "temperature": temperature, "penalties": penalties, "ms_per_step": ms})
                        rows.append([vocab, batch, history, temperature, "on" if penalties else "off", f"{ms:.3f}"])
    print_table(rows, ["vocab", "batch", "history", "T", "penalties", "CPU ms/step"])
    path = write_json(f"sampler_host_t{args.threads}", {"machine": machine_info(), "threads": torch.get_num_threads(),
                                                        "steps": args.steps, "penalties": PENALTIES,
                                                        "results": results}, record=args.record)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
