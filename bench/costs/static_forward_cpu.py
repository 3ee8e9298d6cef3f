"""Does the static forward (specdec/runner/cuda_graphs.py) pay on CPU? Times one uniform forward (decode or a
k+1 window) per mode: the engine's ragged eager forward, the static forward eager, and the static forward under
``torch.compile`` (inductor; the compile time is reported apart).

    python -m bench.costs.static_forward_cpu [--model PATH] [--batch 1 8] [--q-len 1] [--context 256] [--iters 20]

``--model`` defaults to the embedded SmolLM2-135M; ``--model tiny`` builds a tiny random llama (tests/). Prints one
line per (batch, mode): median ms per forward over ``--iters`` rounds after 3 warm-up rounds, the modes timed
round-robin (one call of each per round) so that load from other processes hits them alike.
"""

from __future__ import annotations

import argparse
import functools
import os
import statistics
import sys
import tempfile
import time

import torch

from specdec.cache.kv_pool import KVPool
from specdec.checkpoint.loader import load_model
from specdec.model.config import ModelConfig
from specdec.model.llama import AttentionMetadata
from specdec.runner.cuda_graphs import StaticForwardRunner


def _model_path(name: str | None) -> str:
    if name == "tiny":
        sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "tests"))
        from tiny_models import make_tiny_model

        path = tempfile.mkdtemp()
        make_tiny_model(path, "llama", seed=0, max_position_embeddings=2048)
        return path
    if name is None:
        from specdec.checkpoint.default_model import default_model_path

        return default_model_path()
    return name


def _interleaved_median_ms(steps: dict, iters: int) -> dict:
    """Median ms per call of each step, timed round-robin (one call of each per round) so that a busy neighbour
    slows every mode alike; 3 warm-up rounds first."""
    times = {name: [] for name in steps}
    for round_ in range(3 + iters):
        for name, step in steps.items():
            start = time.perf_counter()
            step()
            if round_ >= 3:
                times[name].append(time.perf_counter() - start)
    return {name: 1e3 * statistics.median(t) for name, t in times.items()}


def _bench_batch(model, config, args, batch: int) -> None:
    bs, q, ctx = args.block_size, args.q_len, args.context
    blocks_per_seq = -(-ctx // bs)
    pool = KVPool(config, 1 + batch * blocks_per_seq, bs, torch.float32, "cpu")  # block 0: the scratch block
    pool.k.normal_()
    pool.v.normal_()
    tables = (1 + torch.arange(batch * blocks_per_seq, dtype=torch.int32)).view(batch, blocks_per_seq)
    seq_lens = torch.full((batch,), ctx, dtype=torch.int32)
    positions = (ctx - q + torch.arange(q)).repeat(batch)  # int64 [batch*q]
    slots = (tables.long().gather(1, (positions // bs).view(batch, q)) * bs + (positions % bs).view(batch, q))
    slots = slots.flatten()  # int64 [batch*q]
    ids = torch.randint(0, config.vocab_size, (batch * q,))
    cu = torch.arange(0, (batch + 1) * q, q, dtype=torch.int32)
    rows = torch.arange(batch * q)
    options = {} if args.no_freezing else {"options": {"freezing": True}}
    steps, first_call = {}, {}
    for mode in args.modes:
        if mode == "ragged":
            meta = AttentionMetadata(slots, tables, seq_lens, cu)
            steps[mode] = functools.partial(model, ids, positions, pool.tensors, meta, rows)
            continue
        runner = StaticForwardRunner(model, pool.tensors, block_size=bs, max_blocks=blocks_per_seq,
                                     scratch_block=0, q_lens=(q,), batch_sizes=(batch,), mode=mode,
                                     compile_options=options)  # fmt: skip
        steps[mode] = functools.partial(runner.run, ids, positions, slots, tables, seq_lens, q)
        start = time.perf_counter()
        steps[mode]()  # compiles on the first call
        first_call[mode] = time.perf_counter() - start
    for mode, ms in _interleaved_median_ms(steps, args.iters).items():
        extra = f" (first call {first_call[mode]:.1f} s)" if mode in first_call else ""
        print(f"batch {batch:3d}  {mode:8s} {ms:8.2f} ms{extra}", flush=True)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None)
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--q-len", type=int, default=1)
    parser.add_argument("--context", type=int, default=256, help="tokens per sequence, new ones included")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--modes", nargs="+", default=["ragged", "eager", "compile"])
    parser.add_argument("--no-freezing", action="store_true", help="compile without Inductor's freezing (which "
                        "packs the linear weights for oneDNN, as the eager CPU path does)")
    args = parser.parse_args(argv)
    torch.manual_seed(0)
    path = _model_path(args.model)
    config = ModelConfig.from_json(path)
    model = load_model(path, torch.float32, torch.device("cpu"), 2048, config)
    bs, q, ctx = args.block_size, args.q_len, args.context
    print(f"model {config.num_hidden_layers} layers, hidden {config.hidden_size}, vocab {config.vocab_size}; "
          f"q_len {q}, context {ctx}, block_size {bs}, threads {torch.get_num_threads()}")
    for batch in args.batch:
        _bench_batch(model, config, args, batch)


if __name__ == "__main__":
    main()
