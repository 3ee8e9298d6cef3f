"""Tree attention (issue 11): attention over a draft tree equals attention along each root-to-leaf path as an
ordinary causal sequence, and a tree batch may mix trees with causal sequences (chains, decodes, prefill chunks)
whose tree-mask slice is empty.

Both the torch reference and the Triton kernel (the interpreter on CPU) are checked, in fp32. Trees come from
``DraftTree`` (DFS order, ``mask()``); K/V go through shuffled block tables with block size 4, so paths and
trees cross block boundaries.
"""

import random

import pytest
import torch

from specdec.kernels import paged_attention as pa
from specdec.kernels.paged_attention import paged_attention, paged_attention_reference
from specdec.spec_decode.tree import DraftTree

BLOCK_SIZE = 4
HQ, HKV, D = 6, 2, 16  # GQA group 3
ATOL = RTOL = 1e-5
IMPLS = {"reference": paged_attention_reference, "kernel": paged_attention}


@pytest.fixture(params=list(IMPLS))
def attention(request):
    if request.param == "kernel" and not pa._INTERPRETED:
        pytest.skip("compiled Triton (TRITON_INTERPRET=0) cannot run on CPU tensors")
    return IMPLS[request.param]


def random_tree(num_nodes: int, rng: random.Random) -> DraftTree:
    """A random tree of ``num_nodes`` nodes (root included) in DFS order: node i hangs off node i - 1 or one of its
    ancestors; distinct tokens, so siblings never repeat one."""
    parents = [-1]
    for i in range(1, num_nodes):
        chain = [i - 1]
        while parents[chain[-1]] != -1:
            chain.append(parents[chain[-1]])
        parents.append(rng.choice(chain))
    return DraftTree(tuple(range(100, 100 + num_nodes)), tuple(parents))


def paged_batch(kvs, q_lens, seed):
    """Cache, block tables, seq_lens and cu_q_lens for sequences whose K/V are ``kvs[b] = (k, v)``, each
    ``[seq_len_b, Hkv, D]`` (the last ``q_lens[b]`` rows are the new tokens'). Blocks are shuffled over a cache
    with spare blocks of random junk."""
    gen = torch.Generator().manual_seed(seed)
    blocks = [-(-k.shape[0] // BLOCK_SIZE) for k, _ in kvs]
    num_blocks = sum(blocks) + 3
    perm = torch.randperm(num_blocks, generator=gen).tolist()
    k_cache = torch.randn(num_blocks, BLOCK_SIZE, HKV, D, generator=gen)
    v_cache = torch.randn(num_blocks, BLOCK_SIZE, HKV, D, generator=gen)
    tables = torch.zeros(len(kvs), max(blocks) + 1, dtype=torch.int32)
    for b, (k, v) in enumerate(kvs):
        table = [perm.pop() for _ in range(blocks[b])]
        tables[b, : blocks[b]] = torch.tensor(table, dtype=torch.int32)
        for p in range(k.shape[0]):
            k_cache[table[p // BLOCK_SIZE], p % BLOCK_SIZE] = k[p]
            v_cache[table[p // BLOCK_SIZE], p % BLOCK_SIZE] = v[p]
    seq_lens = torch.tensor([k.shape[0] for k, _ in kvs], dtype=torch.int32)
    cu_q_lens = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    return k_cache, v_cache, tables, seq_lens, cu_q_lens


def _randn(gen, *shape):
    return torch.randn(*shape, generator=gen)


# ---------------------------------------------------------------------------------- (a) tree == its paths

# (context length, tree nodes incl. the root) per tree of one batch; 21 nodes take the reference's long path
TREE_BATCHES = [
    [(5, 8), (9, 11), (0, 6)],
    [(13, 21), (2, 4)],
    [(7, 1), (3, 16)],
]


@pytest.mark.parametrize("shape", range(len(TREE_BATCHES)))
def test_tree_attention_equals_attention_along_every_path(attention, shape):
    rng, gen = random.Random(shape), torch.Generator().manual_seed(shape)
    trees, contexts, nodes, queries = [], [], [], []
    for ctx, n in TREE_BATCHES[shape]:
        trees.append(random_tree(n, rng))
        contexts.append((_randn(gen, ctx, HKV, D), _randn(gen, ctx, HKV, D)))  # K, V of the context
        nodes.append((_randn(gen, n, HKV, D), _randn(gen, n, HKV, D)))  # K, V of the nodes, DFS order
        queries.append(_randn(gen, n, HQ, D))
    assert any(not t.is_chain() for t in trees)

    # One tree batch: node i of tree b at position ctx_b + i, seeing the context and its ancestors.
    tree_kvs = [(torch.cat([c[0], m[0]]), torch.cat([c[1], m[1]])) for c, m in zip(contexts, nodes, strict=True)]
    q_lens = [t.num_drafts + 1 for t in trees]
    cache_args = paged_batch(tree_kvs, q_lens, seed=shape)
    masks = [t.mask().flatten() for t in trees]
    indptr = torch.tensor([0, *torch.tensor([m.numel() for m in masks]).cumsum(0).tolist()], dtype=torch.int32)
    tree_out = attention(torch.cat(queries), *cache_args, D**-0.5, torch.cat(masks), indptr)

    # One causal batch: every root-to-leaf path of every tree as a sequence of its own (context + path nodes).
    path_kvs, path_q, where = [], [], []  # where: (tree, node) of each path row
    for b, tree in enumerate(trees):
        for leaf in tree.leaves():
            path = [0, *tree.path(leaf)]
            path_kvs.append((torch.cat([contexts[b][0], nodes[b][0][path]]),
                             torch.cat([contexts[b][1], nodes[b][1][path]])))  # fmt: skip
            path_q.append(queries[b][path])
            where += [(b, node) for node in path]
    path_out = attention(torch.cat(path_q), *paged_batch(path_kvs, [len(q) for q in path_q], seed=10 + shape),
                         D**-0.5)  # fmt: skip

    starts = [0, *torch.tensor(q_lens).cumsum(0).tolist()]
    expected = torch.stack([tree_out[starts[b] + node] for b, node in where])
    torch.testing.assert_close(path_out, expected, atol=ATOL, rtol=RTOL)
    # and the tree rows are not what a plain causal window over the DFS order gives (the mask matters here)
    causal_out = attention(torch.cat(queries), *cache_args, D**-0.5)
    assert not torch.allclose(causal_out, tree_out, atol=1e-3)


# ------------------------------------------------------------- (b) trees mixed with causal sequences

# kind, context before the new tokens, new tokens: trees, chains (causal, empty slice), decodes, prefill chunks
# (20 new tokens: the reference's per-sequence path), a sequence with no new token
MIXED = [("tree", 6, 7), ("chain", 9, 5), ("decode", 14, 1), ("prefill", 3, 20), ("tree", 0, 9), ("idle", 5, 0),
         ("decode", 2, 1), ("prefill", 0, 17), ("tree", 11, 4)]  # fmt: skip


def mixed_batch(seed=0):
    """(q, cache args, trees by sequence index (None for causal ones), q_lens)."""
    rng, gen = random.Random(seed), torch.Generator().manual_seed(seed)
    kvs, trees, q_lens = [], [], []
    for kind, ctx, n in MIXED:
        kvs.append((_randn(gen, ctx + n, HKV, D), _randn(gen, ctx + n, HKV, D)))
        trees.append(random_tree(n, rng) if kind == "tree" else None)
        q_lens.append(n)
    q = _randn(gen, sum(q_lens), HQ, D)
    return q, paged_batch(kvs, q_lens, seed), trees, q_lens


def _packed(masks):
    """(tree_mask, tree_mask_indptr) from one flat mask (possibly empty) per sequence."""
    sizes = torch.tensor([m.numel() for m in masks])
    return torch.cat(masks), torch.tensor([0, *sizes.cumsum(0).tolist()], dtype=torch.int32)


def _empty_or_tree(trees):
    return _packed([t.mask().flatten() if t is not None else torch.zeros(0, dtype=torch.bool) for t in trees])


def _explicit(trees, q_lens):
    """The old contract: every sequence carries a full q_len x q_len mask (causal ones a lower triangle)."""
    return _packed([t.mask().flatten() if t is not None else torch.ones(n, n, dtype=torch.bool).tril().flatten()
                    for t, n in zip(trees, q_lens, strict=True)])  # fmt: skip


def test_empty_mask_slices_are_causal_in_a_mixed_batch(attention):
    q, cache_args, trees, q_lens = mixed_batch()
    out = attention(q, *cache_args, D**-0.5, *_empty_or_tree(trees))
    # every row equals the batch with explicit masks for every sequence (causal ones as lower triangles)
    torch.testing.assert_close(out, attention(q, *cache_args, D**-0.5, *_explicit(trees, q_lens)), atol=ATOL,
                               rtol=RTOL)  # fmt: skip
    # the causal sequences' rows equal the batch without any mask
    starts = [0, *torch.tensor(q_lens).cumsum(0).tolist()]
    no_mask = attention(q, *cache_args, D**-0.5)
    causal_rows = torch.cat([torch.arange(starts[b], starts[b + 1]) for b, t in enumerate(trees) if t is None])
    torch.testing.assert_close(out[causal_rows], no_mask[causal_rows], atol=ATOL, rtol=RTOL)
    # and each tree's rows equal that tree alone in a batch of one
    k_cache, v_cache, tables, seq_lens, _ = cache_args
    for b, tree in enumerate(trees):
        if tree is None:
            continue
        rows = slice(starts[b], starts[b + 1])
        alone = attention(q[rows], k_cache, v_cache, tables[b : b + 1], seq_lens[b : b + 1],
                          torch.tensor([0, q_lens[b]], dtype=torch.int32), D**-0.5, *_packed([tree.mask().flatten()]))
        torch.testing.assert_close(out[rows], alone, atol=ATOL, rtol=RTOL)


@pytest.mark.parametrize("num_splits", [2, 5])
def test_empty_mask_slices_with_split_kv(num_splits):
    """The kernel's flash-decoding path (KV split over programs, merged by the reduce kernel) on the mixed batch."""
    if not pa._INTERPRETED:
        pytest.skip("compiled Triton (TRITON_INTERPRET=0) cannot run on CPU tensors")
    q, cache_args, trees, q_lens = mixed_batch(seed=1)
    mask_args = _empty_or_tree(trees)
    out = paged_attention(q, *cache_args, D**-0.5, *mask_args, num_splits=num_splits)
    torch.testing.assert_close(out, paged_attention_reference(q, *cache_args, D**-0.5, *_explicit(trees, q_lens)),
                               atol=ATOL, rtol=RTOL)  # fmt: skip


def test_an_all_empty_tree_mask_is_the_causal_batch(attention):
    q, cache_args, trees, q_lens = mixed_batch(seed=2)
    empty = torch.zeros(0, dtype=torch.bool)
    indptr = torch.zeros(len(q_lens) + 1, dtype=torch.int32)
    torch.testing.assert_close(attention(q, *cache_args, D**-0.5, empty, indptr), attention(q, *cache_args, D**-0.5),
                               atol=ATOL, rtol=RTOL)  # fmt: skip


def test_a_mask_slice_must_be_empty_or_q_len_squared():
    q, cache_args, trees, q_lens = mixed_batch()
    mask, indptr = _empty_or_tree(trees)
    indptr[2:] += 1  # sequence 1 (a chain of 5) now has a 1-entry slice
    mask = torch.cat([mask, torch.zeros(1, dtype=torch.bool)])
    with pytest.raises(ValueError, match=r"sequence 1's tree mask slice .* has 1 entries; it must be empty \(causal\) "
                                         r"or q_len \* w with q_len = 5 <= w <= seq_len = 14"):  # fmt: skip
        paged_attention(q, *cache_args, D**-0.5, mask, indptr)
    mask, indptr = _empty_or_tree(trees)
    with pytest.raises(ValueError, match="must lie within tree_mask"):
        paged_attention(q, *cache_args, D**-0.5, mask[:-1], indptr)


# ------------------------------------------------------------- (c) a mask wider than the new tokens (draft levels)


@pytest.mark.parametrize("new", [1, 3, 6])
def test_a_wide_mask_over_cached_tree_nodes_equals_the_square_window(attention, new):
    """A draft model's tree level feeds only its new nodes, masking the last w keys: the tree's nodes cached by
    earlier levels and the new ones. Its rows must equal the same nodes' rows when the whole tree is fed at once
    with the square mask (the nodes' K/V identical in both)."""
    rng, gen = random.Random(new), torch.Generator().manual_seed(new)
    tree = random_tree(11, rng)
    ctx, w = 6, 11  # context before the tree (root included in the tree here), tree nodes
    k, v = _randn(gen, ctx + w, HKV, D), _randn(gen, ctx + w, HKV, D)
    q_all = _randn(gen, w, HQ, D)
    full = attention(q_all, *paged_batch([(k, v)], [w], seed=new), D**-0.5, *_packed([tree.mask().flatten()]))
    wide = tree.mask()[w - new :].contiguous()  # [new, w]: the last `new` nodes over all w tree keys
    out = attention(q_all[w - new :].contiguous(), *paged_batch([(k, v)], [new], seed=new), D**-0.5,
                    *_packed([wide.flatten()]))
    torch.testing.assert_close(out, full[w - new :], atol=ATOL, rtol=RTOL)
    # a slice whose width exceeds seq_len, or is not a multiple of q_len, is refused
    with pytest.raises(ValueError, match="q_len \\* w"):
        paged_attention(q_all[w - new :].contiguous(), *paged_batch([(k, v)], [new], seed=new), D**-0.5,
                        *_packed([torch.ones(new * (ctx + w + 1), dtype=torch.bool)]))
