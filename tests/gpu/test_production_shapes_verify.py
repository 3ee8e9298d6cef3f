"""Production-shape correctness on CUDA for the verification kernels added with token trees: block verification,
tree verification and KV compaction, each compiled kernel against its torch reference ON THE GPU (same contract
as ``test_production_shapes.py``: marked ``gpu``, fails without CUDA; ``DEVICE`` may be pointed at "cpu" with
tiny shapes for a self-check in the interpreter).
"""

from __future__ import annotations

import random

import pytest
import test_production_shapes as shapes
import torch
from test_production_shapes import VOCABS, _gen, spec_batch

from specdec import ops
from specdec.kernels.block_verify import block_verify
from specdec.kernels.kv_compact import kv_compact
from specdec.kernels.tree_sample import tree_sample
from specdec.spec_decode.tree import DraftTree

pytestmark = pytest.mark.gpu


@pytest.fixture(autouse=True)
def _needs_cuda():
    if shapes.DEVICE == "cuda" and not torch.cuda.is_available():
        pytest.fail("needs CUDA: tests/gpu checks the compiled kernels on a GPU (run them on a CUDA machine)")


def check_block_verify(vocab: int, batch: int, k: int) -> None:
    args = spec_batch(batch, k, vocab, seed=vocab % 997 + batch * 10 + k)
    out, acc = block_verify(**args)
    with ops.force_reference():
        ref_out, ref_acc = ops.block_verify(**args)
    torch.testing.assert_close(acc, ref_acc, rtol=0, atol=0)
    torch.testing.assert_close(out, ref_out, rtol=0, atol=0)


@pytest.mark.parametrize("k", [4, 8])
@pytest.mark.parametrize("batch", [1, 8, 64])
@pytest.mark.parametrize("vocab", VOCABS)
def test_block_verify(vocab, batch, k):
    check_block_verify(vocab, batch, k)


def random_tree(nodes: int, vocab: int, rng: random.Random) -> DraftTree:
    """A random DFS-ordered tree of ``nodes`` nodes (root included) with distinct sibling tokens."""
    parents, tokens = [-1], [rng.randrange(vocab)]
    for i in range(1, nodes):
        path = [i - 1]
        while parents[path[-1]] != -1:
            path.append(parents[path[-1]])
        parent = rng.choice(path)
        used = {tokens[j] for j in range(i) if parents[j] == parent}
        token = rng.randrange(vocab)
        while token in used:
            token = rng.randrange(vocab)
        parents.append(parent)
        tokens.append(token)
    return DraftTree(tuple(tokens), tuple(parents))


def tree_batch(batch: int, nodes: int, vocab: int, seed: int) -> dict:
    """tree_sample inputs: ``batch`` random trees of up to ``nodes`` nodes, mixed greedy / one-hot / sampled."""
    rng, gen, dgen = random.Random(seed), torch.Generator().manual_seed(seed), _gen(seed)
    trees = [random_tree(rng.randint(1, nodes), vocab, rng) for _ in range(batch)]
    total = sum(len(t.token_ids) for t in trees)
    target_logits = 3 * torch.randn(total, vocab, generator=dgen, device=shapes.DEVICE)
    draft_logits = target_logits + 0.5 * torch.randn(total, vocab, generator=dgen, device=shapes.DEVICE)
    greedy = torch.rand(batch, generator=gen) < 0.25
    onehot = (torch.rand(batch, generator=gen) < 0.25) & ~greedy
    cu = [0]
    for t in trees:
        cu.append(cu[-1] + len(t.token_ids))
    dev = shapes.DEVICE
    return {
        "node_token_ids": torch.tensor([x for t in trees for x in t.token_ids], device=dev),
        "node_parents": torch.tensor([p for t in trees for p in t.parents], dtype=torch.int32, device=dev),
        "cu_num_nodes": torch.tensor(cu, dtype=torch.int32, device=dev),
        "draft_probs": torch.softmax(draft_logits, -1), "target_probs": torch.softmax(target_logits, -1),
        "target_argmax": target_logits.argmax(-1), "is_greedy": greedy.to(dev), "draft_is_onehot": onehot.to(dev),
        "seeds": torch.randint(0, 2**62, (batch,), generator=gen).to(dev),
        "positions": torch.randint(0, 1 << 20, (batch,), generator=gen).to(dev),
        "max_depth": max(t.max_depth for t in trees),
    }  # fmt: skip


@pytest.mark.parametrize("nodes", [9, 22])
@pytest.mark.parametrize("batch", [1, 8, 32])
@pytest.mark.parametrize("vocab", VOCABS)
def test_tree_sample(vocab, batch, nodes):
    args = tree_batch(batch, nodes, vocab, seed=vocab % 991 + batch + nodes)
    out = tree_sample(**args)
    with ops.force_reference():
        ref = ops.tree_sample(**args)
    for got, want in zip(out, ref, strict=True):
        torch.testing.assert_close(got, want, rtol=0, atol=0)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize("moves", [1, 64, 512])
def test_kv_compact(moves, dtype):
    """Llama-3.2-3B's pool shape (28 layers, 8 KV heads, D = 128): kernel and reference move the same bits."""
    gen = torch.Generator().manual_seed(moves)
    layers, blocks, block_size, hkv, d = (28, 256, 16, 8, 128) if shapes.DEVICE == "cuda" else (2, 16, 4, 2, 8)
    caches = [torch.randn(layers, blocks, block_size, hkv, d, generator=gen).to(dtype).to(shapes.DEVICE)
              for _ in range(2)]
    slots = torch.randperm(blocks * block_size, generator=gen)
    moves = min(moves, blocks * block_size // 2)
    src, dst = slots[:moves].to(shapes.DEVICE), slots[moves : 2 * moves].to(shapes.DEVICE)
    expected = [c.clone() for c in caches]
    with ops.force_reference():
        ops.kv_compact(expected, src, dst)
    kv_compact(caches, src, dst)
    for got, want in zip(caches, expected, strict=True):
        assert torch.equal(got, want)
