"""The static-shape forward of uniform batches (decode, draft step, k+1 verification window) on CPU.

- ``paged_attention_uniform_reference`` (host-read free, fixed shapes) computes what the ragged reference does;
- the Triton launcher's uniform plan comes from shapes only (it plans ``meta`` tensors, which have no values);
- the model forward with ``uniform_q_len`` passes ``torch.compile(fullgraph=True)``, matches eager, and a call
  with other seq_lens / block tables / tokens of the same shapes does not recompile - the structural proof that
  the forward a CUDA graph captures reads nothing on the host;
- ``StaticForwardRunner`` (specdec/runner/cuda_graphs.py): buckets, padding rows that touch only the scratch
  block, rows of a previous larger batch reset, fallbacks.
"""

from __future__ import annotations

import pytest
import torch
from runner_helpers import BLOCK_SIZE, NUM_BLOCKS, K, uniform_batch
from tiny_models import make_tiny_model

from specdec import ops
from specdec.cache.block_manager import BlockManager
from specdec.checkpoint.loader import load_model
from specdec.kernels.paged_attention import launch_plan, paged_attention_uniform
from specdec.kernels.paged_attention_reference import paged_attention_reference, paged_attention_uniform_reference
from specdec.model.config import ModelConfig
from specdec.model.llama import AttentionMetadata
from specdec.runner.cuda_graphs import BucketKey, StaticForwardRunner, reserve_scratch_block


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("static_tiny"))
    make_tiny_model(path, "llama", seed=5, num_heads=4, num_kv_heads=2)
    return path


@pytest.fixture(scope="module")
def tiny(tiny_path):
    path = tiny_path
    config = ModelConfig.from_json(path)
    return load_model(path, torch.float32, torch.device("cpu"), 256, config, prepack_weights=False), config


def new_pool(config, seed=0):
    gen = torch.Generator().manual_seed(seed)
    shape = (config.num_hidden_layers, NUM_BLOCKS, BLOCK_SIZE, config.num_key_value_heads, config.head_dim)
    return torch.randn(shape, generator=gen), torch.randn(shape, generator=gen)


def eager_logits(model, pool, batch, q_len=None) -> torch.Tensor:
    """The engine's forward over ``batch`` (ragged path unless ``q_len``), every row's logits."""
    meta = AttentionMetadata(batch["slot_mapping"], batch["block_tables"], batch["seq_lens"], batch["cu_q_lens"],
                             uniform_q_len=q_len)  # fmt: skip
    rows = torch.arange(batch["input_ids"].shape[0])
    return model(batch["input_ids"], batch["positions"], pool, meta, rows)


# ------------------------------------------------------------------------------------------- attention


@pytest.mark.parametrize("q_len", [1, K + 1])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_uniform_reference_equals_the_ragged_reference(q_len, dtype):
    gen = torch.Generator().manual_seed(q_len)
    hq, hkv, d = 6, 2, 16
    k_cache = torch.randn(NUM_BLOCKS, BLOCK_SIZE, hkv, d, generator=gen).to(dtype)
    v_cache = torch.randn(NUM_BLOCKS, BLOCK_SIZE, hkv, d, generator=gen).to(dtype)
    batch = uniform_batch([q_len, 9, 17, 4 + q_len], q_len, 10, seed=q_len, width=7)
    q = torch.randn(4 * q_len, hq, d, generator=gen).to(dtype)
    args = (q, k_cache, v_cache, batch["block_tables"], batch["seq_lens"])
    got = paged_attention_uniform_reference(*args, q_len, 0.25)
    expected = paged_attention_reference(*args, batch["cu_q_lens"], 0.25)
    assert got.shape == expected.shape and got.dtype == dtype
    tol = 1e-6 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(got, expected, atol=tol, rtol=tol)
    # and the context length matters (a mask that ignored seq_lens would not notice a shorter sequence)
    shorter = batch["seq_lens"].clone()
    shorter[2] -= 3
    changed = paged_attention_uniform_reference(q, k_cache, v_cache, batch["block_tables"], shorter, q_len, 0.25)
    assert not torch.allclose(changed[2 * q_len:3 * q_len], got[2 * q_len:3 * q_len])


def test_ops_dispatches_uniform_batches_to_the_static_path(monkeypatch):
    q, k_cache = torch.randn(2, 2, 8), torch.randn(4, 4, 1, 8)
    tables, lens, cu = torch.tensor([[1], [2]], dtype=torch.int32), torch.tensor([3, 2], dtype=torch.int32), None
    calls = []
    real = ops._attention_reference.paged_attention_uniform_reference
    monkeypatch.setattr(ops._attention_reference, "paged_attention_uniform_reference",
                        lambda *a: calls.append(a[5]) or real(*a))
    out = ops.paged_attention(q, k_cache, k_cache, tables, lens, cu, 0.3, uniform_q_len=1)
    assert calls == [1] and out.shape == q.shape
    with pytest.raises(ValueError, match="tree mask"):
        ops.paged_attention(q, k_cache, k_cache, tables, lens, cu, 0.3, torch.ones(2, dtype=torch.bool),
                            torch.tensor([0, 1, 2], dtype=torch.int32), uniform_q_len=1)


@pytest.mark.parametrize("q_len", [1, K + 1])
def test_triton_uniform_launch_matches_the_reference_in_the_interpreter(q_len):
    gen = torch.Generator().manual_seed(7)
    hq, hkv, d = 4, 2, 16
    k_cache, v_cache = torch.randn(NUM_BLOCKS, BLOCK_SIZE, hkv, d, generator=gen), torch.randn(
        NUM_BLOCKS, BLOCK_SIZE, hkv, d, generator=gen)
    batch = uniform_batch([q_len + 2, 11], q_len, 10, seed=3)
    batch["block_tables"][batch["block_tables"] >= NUM_BLOCKS] = 0  # the interpreter checks every table entry
    q = torch.randn(2 * q_len, hq, d, generator=gen)
    args = (q, k_cache, v_cache, batch["block_tables"], batch["seq_lens"])
    with ops.force_triton():
        got = ops.paged_attention(*args, batch["cu_q_lens"], 0.25, uniform_q_len=q_len)
    torch.testing.assert_close(got, paged_attention_uniform_reference(*args, q_len, 0.25), atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="needs 6 q rows"):
        paged_attention_uniform(torch.randn(5, hq, d), k_cache, v_cache, torch.zeros(2, 3, dtype=torch.int32),
                                torch.ones(2, dtype=torch.int32), torch.zeros(3, dtype=torch.int32), 3, 0.25)


@pytest.mark.parametrize("batch,q_len,max_blocks", [(1, 1, 512), (8, 1, 512), (64, K + 1, 128), (4, 9, 2)])
def test_triton_uniform_plan_reads_no_device_value(batch, q_len, max_blocks):
    """The launcher plans ``meta`` tensors (shapes, no storage): any host read of a value would raise. The grid
    and the split plan are therefore the same for every replay of a bucket."""
    meta = torch.device("meta")
    hq, hkv, d = 32, 8, 64
    q = torch.empty(batch * q_len, hq, d, device=meta, dtype=torch.bfloat16)
    cache = torch.empty(1000, 16, hkv, d, device=meta, dtype=torch.bfloat16)
    tables = torch.empty(batch, max_blocks, device=meta, dtype=torch.int32)
    lens = torch.empty(batch, device=meta, dtype=torch.int32)
    cu = torch.empty(batch + 1, device=meta, dtype=torch.int32)
    plan = launch_plan(q, cache, cache, tables, lens, cu, 0.125)
    block_q = plan.constexprs["BLOCK_Q"]
    assert plan.grid[:2] == (batch * q_len // block_q + batch, hkv)
    assert plan.constexprs["TREE"] is False


# ------------------------------------------------------------------------------------------- torch.compile


@pytest.mark.parametrize("q_len", [1, K + 1])
def test_uniform_forward_compiles_fullgraph_matches_eager_and_does_not_recompile(tiny, q_len):
    model, config = tiny
    pool = new_pool(config)
    compiled_pool = tuple(t.clone() for t in pool)

    def forward(ids, positions, slots, tables, lens, cu, rows):
        meta = AttentionMetadata(slots, tables, lens, cu, uniform_q_len=q_len)
        return model.forward_traceable(ids, positions, compiled_pool, meta, rows)

    torch._dynamo.reset()
    compiled = torch.compile(forward, fullgraph=True, backend="aot_eager")
    rows = torch.arange(3 * q_len)
    for seed, lens in enumerate(([q_len, 10, 23], [17, q_len + 5, 6 + q_len])):
        batch = uniform_batch(lens, q_len, config.vocab_size, seed=seed, width=7)
        expected = eager_logits(model, pool, batch)
        with torch.no_grad(), torch._dynamo.config.patch(error_on_recompile=seed > 0):
            got = compiled(batch["input_ids"], batch["positions"], batch["slot_mapping"], batch["block_tables"],
                           batch["seq_lens"], batch["cu_q_lens"], rows)  # fmt: skip
        torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)
        assert torch.equal(got.argmax(-1), expected.argmax(-1))
        torch.testing.assert_close(compiled_pool[0], pool[0], atol=1e-5, rtol=1e-5)  # the same K/V written
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] >= 1


# ------------------------------------------------------------------------------------------- the runner


def make_runner(model, pool, mode="eager", **kw) -> StaticForwardRunner:
    kw = {"block_size": BLOCK_SIZE, "max_blocks": 8, "scratch_block": 0, "q_lens": (1, K + 1),
          "batch_sizes": (1, 2, 4), **kw}  # fmt: skip
    return StaticForwardRunner(model, pool, mode=mode, **kw)


def test_bucket_selection_and_fallbacks(tiny):
    model, config = tiny
    runner = make_runner(model, new_pool(config), block_buckets=(2, 8))
    assert runner.bucket(1, 1, 1) == BucketKey(1, 1, 2)
    assert runner.bucket(3, K + 1, 3) == BucketKey(4, K + 1, 8)
    assert runner.bucket(4, 1, 8) == BucketKey(4, 1, 8)
    assert runner.bucket(5, 1, 1) is None  # more sequences than the largest bucket
    assert runner.bucket(2, 2, 1) is None  # a q_len not served
    assert runner.bucket(2, 1, 9) is None  # a wider block table than max_blocks
    assert runner.keys()[0] == BucketKey(4, K + 1, 8) and len(runner.keys()) == 12
    batch = uniform_batch([5] * 5, 1, config.vocab_size, seed=1)
    assert runner.run(batch["input_ids"], batch["positions"], batch["slot_mapping"], batch["block_tables"],
                      batch["seq_lens"], 1) is None  # fmt: skip
    assert runner.num_fallbacks == 1 and runner.num_replays == 0


def test_runner_rejects_bad_arguments(tiny):
    model, config = tiny
    pool = new_pool(config)
    with pytest.raises(ValueError, match="needs the model on CUDA"):
        make_runner(model, pool, mode="cuda_graph")
    with pytest.raises(ValueError, match="mode must be"):
        make_runner(model, pool, mode="graphs")
    with pytest.raises(ValueError, match="scratch_block"):
        make_runner(model, pool, scratch_block=NUM_BLOCKS)
    with pytest.raises(ValueError, match="block_buckets"):
        make_runner(model, pool, block_buckets=(9,))
    with pytest.raises(ValueError, match="batch_sizes"):
        make_runner(model, pool, batch_sizes=(0, 2))
    runner = make_runner(model, pool)
    batch = uniform_batch([5, 6], 1, config.vocab_size, seed=1)
    with pytest.raises(ValueError, match="uniform batch of 2 sequences x q_len 2"):
        runner.run(batch["input_ids"], batch["positions"], batch["slot_mapping"], batch["block_tables"],
                   batch["seq_lens"], 2)  # fmt: skip


def test_reserve_scratch_block_takes_one_private_block():
    bm = BlockManager(8, BLOCK_SIZE, enable_prefix_caching=True)
    block = reserve_scratch_block(bm)
    assert bm.num_free_blocks == 7 and bm.refcount(block) == 1


@pytest.mark.parametrize("mode", ["eager", "compile"])
@pytest.mark.parametrize("q_len", [1, K + 1])
def test_padded_bucket_matches_eager_and_padding_touches_only_the_scratch_block(tiny, mode, q_len):
    model, config = tiny
    pool = new_pool(config)
    runner_pool = tuple(t.clone() for t in pool)
    runner = make_runner(model, runner_pool, mode=mode, compile_options={"backend": "aot_eager"})
    batch = uniform_batch([q_len + 3, 14, 9], q_len, config.vocab_size, seed=q_len, width=5)  # 3 rows in bucket 4
    expected = eager_logits(model, pool, batch)
    got = runner.run(batch["input_ids"], batch["positions"], batch["slot_mapping"], batch["block_tables"],
                     batch["seq_lens"], q_len)  # fmt: skip
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)
    assert torch.equal(got.argmax(-1), expected.argmax(-1)) and runner.num_replays == 1
    written = set((batch["slot_mapping"] // BLOCK_SIZE).tolist())
    untouched = [b for b in range(NUM_BLOCKS) if b not in written and b != 0]  # block 0: the scratch block
    for initial, after, eager_written in zip(new_pool(config), runner_pool, pool):
        assert torch.equal(after[:, untouched], initial[:, untouched])
        torch.testing.assert_close(after[:, sorted(written)], eager_written[:, sorted(written)], atol=1e-5, rtol=1e-5)
    # logits_indices select among the real rows
    rows = torch.tensor([q_len - 1, 3 * q_len - 1])
    picked = runner.run(batch["input_ids"], batch["positions"], batch["slot_mapping"], batch["block_tables"],
                        batch["seq_lens"], q_len, rows)  # fmt: skip
    torch.testing.assert_close(picked, expected[rows], atol=1e-4, rtol=1e-4)


def test_padded_bucket_through_the_triton_kernel_matches_eager_in_the_interpreter(tiny):
    """The CUDA path's attention (the uniform Triton launch, padding rows included) inside the whole forward, run
    by the interpreter: the same logits as the eager ragged forward through the ragged launch."""
    model, config = tiny
    pool = new_pool(config)
    runner_pool = tuple(t.clone() for t in pool)
    runner = make_runner(model, runner_pool)
    batch = uniform_batch([K + 3, 14, 9], K + 1, config.vocab_size, seed=4, width=5)
    batch["block_tables"][batch["block_tables"] >= NUM_BLOCKS] = 0  # the interpreter checks every table entry
    with ops.force_triton():
        expected = eager_logits(model, pool, batch)
        got = runner.run(batch["input_ids"], batch["positions"], batch["slot_mapping"], batch["block_tables"],
                         batch["seq_lens"], K + 1)  # fmt: skip
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)
    assert torch.equal(got.argmax(-1), expected.argmax(-1))


def test_a_smaller_batch_resets_the_rows_of_a_previous_larger_one(tiny):
    """Row 3 of bucket 4 held a real sequence in the first step; in the second (3 sequences, bucket 4 again) it
    must be padding again, or it would rewrite that sequence's slot (which may since belong to someone else)."""
    model, config = tiny
    pool = new_pool(config)
    runner = make_runner(model, pool)
    first = uniform_batch([6, 7, 8, 9], 1, config.vocab_size, seed=2)
    runner.run(first["input_ids"], first["positions"], first["slot_mapping"], first["block_tables"],
               first["seq_lens"], 1)  # fmt: skip
    stale = first["slot_mapping"][3:]
    for cache in pool:  # those slots are freed and reused: mark them
        cache.view(config.num_hidden_layers, -1, config.num_key_value_heads, config.head_dim)[:, stale] = 7.0
    second = {k: (v[:3] if k != "cu_q_lens" else v[:4]) for k, v in first.items()}
    got = runner.run(second["input_ids"], second["positions"], second["slot_mapping"], second["block_tables"],
                     second["seq_lens"], 1)  # fmt: skip
    assert got.shape == (3, config.vocab_size) and runner.bucket(3, 1, 3).batch == 4
    for cache in pool:
        flat = cache.view(config.num_hidden_layers, -1, config.num_key_value_heads, config.head_dim)
        assert bool((flat[:, stale] == 7.0).all())


def test_uniform_q_len_and_the_engine_mode():
    from types import SimpleNamespace as Item

    from specdec.runner.cuda_graphs import static_forward_mode, uniform_q_len

    def item(n, mask=None, positions=None):
        return Item(token_ids=[1] * n, mask=mask, positions=positions)

    assert uniform_q_len([item(1), item(1)]) == 1
    assert uniform_q_len([item(4), item(4)]) == 4
    assert uniform_q_len([item(4), item(1)]) is None  # a window next to a decode
    assert uniform_q_len([item(4, mask=torch.ones(4, 4, dtype=torch.bool))]) is None  # a tree
    assert uniform_q_len([item(2, positions=[5, 5])]) is None  # tree positions
    assert uniform_q_len([]) is None
    assert static_forward_mode(torch.device("cuda"), enforce_eager=False) == "cuda_graph"
    assert static_forward_mode(torch.device("cuda"), enforce_eager=True) is None
    assert static_forward_mode(torch.device("cpu"), enforce_eager=False) is None


def test_enforce_eager_option(tiny_path):
    from specdec.config import EngineConfig

    assert EngineConfig.create(tiny_path, device="cpu", max_model_len=64).enforce_eager is False
    assert EngineConfig.create(tiny_path, device="cpu", max_model_len=64, enforce_eager=True).enforce_eager is True
    with pytest.raises(ValueError, match="enforce_eager must be True or False"):
        EngineConfig.create(tiny_path, device="cpu", max_model_len=64, enforce_eager="yes")


def test_compile_mode_buckets_are_separate_compilations_not_recompiles(tiny):
    """Each bucket's static forward has its own code object: a second bucket is a first compilation (a shared
    function would be a recompile of the first, and after 8 buckets Dynamo's recompile limit would fall back)."""
    model, config = tiny
    runner = make_runner(model, new_pool(config), mode="compile", compile_options={"backend": "eager"})
    torch._dynamo.reset()
    with torch._dynamo.config.patch(error_on_recompile=True):
        for lens in ([5, 9, 6], [7], [8, 10]):  # buckets 4, 1, 2
            batch = uniform_batch(lens, 1, config.vocab_size, seed=len(lens))
            got = runner.run(batch["input_ids"], batch["positions"], batch["slot_mapping"], batch["block_tables"],
                             batch["seq_lens"], 1)  # fmt: skip
            assert got.shape == (len(lens), config.vocab_size)
    assert sorted(k.batch for k in runner._batches) == [1, 2, 4]


@pytest.mark.slow
@pytest.mark.parametrize("q_len", [1, K + 1])
def test_inductor_compiled_runner_matches_eager_and_writes_kv_in_place(tiny, q_len):
    """Inductor itself (not only tracing): logits and the K/V written match eager. Slow: ~15-30 s of compiling."""
    model, config = tiny
    pool = new_pool(config)
    runner_pool = tuple(t.clone() for t in pool)
    runner = make_runner(model, runner_pool, mode="compile", compile_options={"options": {"freezing": True}})
    for seed, lens in enumerate(([q_len + 3, 14, 9], [20, q_len, 5])):
        batch = uniform_batch(lens, q_len, config.vocab_size, seed=seed, width=5)
        expected = eager_logits(model, pool, batch)
        got = runner.run(batch["input_ids"], batch["positions"], batch["slot_mapping"], batch["block_tables"],
                         batch["seq_lens"], q_len)  # fmt: skip
        torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)
        assert torch.equal(got.argmax(-1), expected.argmax(-1))
        written = sorted(set((batch["slot_mapping"] // BLOCK_SIZE).tolist()))
        for after, eager_written in zip(runner_pool, pool):
            torch.testing.assert_close(after[:, written], eager_written[:, written], atol=1e-5, rtol=1e-5)
