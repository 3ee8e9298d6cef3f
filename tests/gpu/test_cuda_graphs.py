"""CUDA graphs of the static forward (specdec/runner/cuda_graphs.py) on a GPU: replay == eager.

Run on a CUDA machine with ``python -m pytest -m gpu tests/gpu`` (``python -m bench.gpu``'s tests step). Marked
``gpu``: excluded from the default run; selected without CUDA every test FAILS ("needs CUDA"). The CPU side of the
same runner (buckets, padding rows, fallbacks, the compiled static forward) is tests/unit/runner/test_static_forward.py.

Each case builds a tiny random llama on the GPU, runs a uniform batch (decode: q_len 1; verification: k + 1)
through the eager ragged forward and through the runner's captured graph on copies of one KV pool, and compares
logits (fp32: identical argmax, close logits; bf16: close logits), the K/V written, and that the padding rows of
the bucket touched only the scratch block. A second replay with other lengths / tables / tokens checks that the
graph reads its buffers, not values frozen at capture.
"""

from __future__ import annotations

import pytest
import torch
from runner_helpers import BLOCK_SIZE, NUM_BLOCKS, K, uniform_batch
from tiny_models import make_tiny_model

from specdec.checkpoint.loader import load_model
from specdec.model.config import ModelConfig
from specdec.model.llama import AttentionMetadata
from specdec.runner.cuda_graphs import StaticForwardRunner

pytestmark = pytest.mark.gpu
DEVICE = "cuda"  # a self-check may point DEVICE at "cpu" and MODE at "eager" and call the test functions directly
MODE = "cuda_graph"


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("graph_tiny"))
    make_tiny_model(path, "llama", seed=11, hidden_size=128, num_heads=4, num_kv_heads=2, intermediate_size=256)
    return path


def _setup(path, dtype):
    config = ModelConfig.from_json(path)
    model = load_model(path, dtype, torch.device(DEVICE), 256, config)
    gen = torch.Generator(device=DEVICE).manual_seed(0)
    shape = (config.num_hidden_layers, NUM_BLOCKS, BLOCK_SIZE, config.num_key_value_heads, config.head_dim)
    pool = (torch.randn(shape, generator=gen, device=DEVICE).to(dtype),
            torch.randn(shape, generator=gen, device=DEVICE).to(dtype))
    return model, config, pool


def _on_device(batch):
    return {k: v.to(DEVICE) for k, v in batch.items()}


def _eager(model, pool, batch):
    meta = AttentionMetadata(batch["slot_mapping"], batch["block_tables"], batch["seq_lens"], batch["cu_q_lens"])
    return model(batch["input_ids"], batch["positions"], pool, meta,
                 torch.arange(batch["input_ids"].shape[0], device=DEVICE))


def _run(runner, batch, q_len):
    return runner.run(batch["input_ids"], batch["positions"], batch["slot_mapping"], batch["block_tables"],
                      batch["seq_lens"], q_len)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("q_len", [1, K + 1])
def test_graph_replay_equals_eager(tiny_path, dtype, q_len):
    model, config, pool = _setup(tiny_path, dtype)
    initial = tuple(t.clone() for t in pool)
    graph_pool = tuple(t.clone() for t in pool)
    runner = StaticForwardRunner(model, graph_pool, block_size=BLOCK_SIZE, max_blocks=8, scratch_block=0,
                                 q_lens=(1, K + 1), batch_sizes=(1, 2, 4, 8), mode=MODE)
    runner.prepare()
    assert all((runner._batches[key].graph is not None) == (MODE == "cuda_graph") for key in runner.keys())
    tol = 1e-4 if dtype == torch.float32 else 5e-2
    for seed, lens in enumerate(([q_len + 2, 14, 9], [30, q_len, 21, 7, 12], [q_len + 1])):
        batch = _on_device(uniform_batch(lens, q_len, config.vocab_size, seed=seed, width=8))
        batch["block_tables"][batch["block_tables"] >= NUM_BLOCKS] = 0
        expected = _eager(model, pool, batch)
        got = _run(runner, batch, q_len)
        torch.testing.assert_close(got, expected, atol=tol, rtol=tol)
        if dtype == torch.float32:
            assert torch.equal(got.argmax(-1), expected.argmax(-1))
        written = set((batch["slot_mapping"] // BLOCK_SIZE).tolist())
        untouched = [b for b in range(NUM_BLOCKS) if b not in written and b != 0]
        for before, after, eager_written in zip(initial, graph_pool, pool):
            assert torch.equal(after[:, untouched], before[:, untouched]), "a padding row wrote outside the scratch"
            idx = sorted(written)
            torch.testing.assert_close(after[:, idx], eager_written[:, idx], atol=tol, rtol=tol)
        initial = tuple(t.clone() for t in graph_pool)
    assert runner.num_replays == 3 and runner.num_fallbacks == 0


def test_a_batch_larger_than_the_largest_bucket_falls_back(tiny_path):
    model, config, pool = _setup(tiny_path, torch.float32)
    runner = StaticForwardRunner(model, pool, block_size=BLOCK_SIZE, max_blocks=8, scratch_block=0, q_lens=(1,),
                                 batch_sizes=(1, 2), mode=MODE)  # fmt: skip
    batch = _on_device(uniform_batch([5, 6, 7], 1, config.vocab_size, seed=0))
    assert _run(runner, batch, 1) is None
    assert runner.num_fallbacks == 1 and not runner._batches  # nothing captured for it
    assert _run(runner, _on_device(uniform_batch([5, 6], 1, config.vocab_size, seed=0)), 1) is not None
