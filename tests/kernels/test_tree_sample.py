"""Tree verification: the kernel against its torch reference, a chain tree against spec_sample, greedy semantics,
exact one-hot cases, invariants and input validation.

On CPU the kernel runs in the Triton interpreter (~1000x slower than torch), so trees and vocabularies stay small
and ``block_v`` is forced below the vocabulary to cover the chunked passes. On CUDA the same tests run compiled.
"""

from __future__ import annotations

import pytest
import torch
from verify_helpers import (
    COMMON_BAD_INPUTS,
    DEVICES,
    check_bad_input,
    check_ops_dispatch,
    make_cu,
    onehot_probs,
    to_device,
    with_changes,
)

from specdec import ops
from specdec.kernels.philox import STREAM_DRAFT, row_exponentials
from specdec.kernels.spec_sample import spec_sample, spec_sample_reference
from specdec.kernels.tree_sample import tree_sample, tree_sample_config, tree_sample_reference


def random_parents(num_drafts: int, gen: torch.Generator) -> list[int]:
    """A random tree in DFS order: each new node hangs off a node on the path to the previous one."""
    parents, path = [-1], [0]
    for i in range(1, num_drafts + 1):
        cut = int(torch.randint(0, len(path), (1,), generator=gen))
        if torch.rand(1, generator=gen) < 0.5:  # bias towards deep trees
            cut = len(path) - 1
        path = path[: cut + 1]
        parents.append(path[-1])
        path.append(i)
    return parents


def depths_of(parents: list[int]) -> list[int]:
    depths = [0] * len(parents)
    for i in range(1, len(parents)):
        depths[i] = depths[parents[i]] + 1
    return depths


def random_tree_batch(trees: list[list[int]], vocab: int, seed: int, kinds: list[str], device="cpu"):
    """Inputs for ``tree_sample``: request b has parents ``trees[b]`` and kind ``kinds[b]`` in
    {"sampled", "onehot", "greedy"}. Sampled children are drawn without replacement from q (Gumbel-top-k), one-hot
    and greedy children are distinct tokens that are the target's mode about half the time."""
    gen = torch.Generator().manual_seed(seed)
    sizes = [len(p) for p in trees]
    total = sum(sizes)
    target_logits = 2.0 * torch.randn(total, vocab, generator=gen)
    draft_logits = target_logits + 0.7 * torch.randn(total, vocab, generator=gen)
    target_probs, draft_probs = torch.softmax(target_logits, -1), torch.softmax(draft_logits, -1)
    tokens = torch.zeros(total, dtype=torch.int64)
    base = 0
    for parents, kind in zip(trees, kinds):
        tokens[base] = int(torch.randint(0, vocab, (1,), generator=gen))  # root: the last committed token
        for node in range(len(parents)):
            kids = [i for i in range(len(parents)) if parents[i] == node]
            if not kids:
                continue
            row = base + node
            if kind == "sampled":
                noise = -torch.log(torch.rand(vocab, generator=gen))
                order = (draft_probs[row] / noise).argsort(descending=True)
            else:
                order = torch.randperm(vocab, generator=gen)
                if torch.rand(1, generator=gen) < 0.5:
                    mode = target_logits[row].argmax()
                    order = torch.cat([mode[None], order[order != mode]])
                    slot = int(torch.randint(0, len(kids), (1,), generator=gen))  # the mode at any sibling rank
                    order[[0, slot]] = order[[slot, 0]]
            for kid, token in zip(kids, order.tolist()):
                tokens[base + kid] = token
        base += len(parents)
    batch = len(trees)
    args = {
        "node_token_ids": tokens,
        "node_parents": torch.tensor([p for parents in trees for p in parents], dtype=torch.int32),
        "cu_num_nodes": make_cu(sizes),
        "draft_probs": draft_probs,
        "target_probs": target_probs,
        "target_argmax": target_logits.argmax(dim=-1),
        "is_greedy": torch.tensor([k == "greedy" for k in kinds]),
        "draft_is_onehot": torch.tensor([k == "onehot" for k in kinds]),
        "seeds": torch.randint(-(2**63), 2**63 - 1, (batch,), generator=gen),
        "positions": torch.randint(0, 1 << 40, (batch,), generator=gen),
        "max_depth": max(max(depths_of(p)) for p in trees),
    }
    return to_device(args, device)


def check_invariants(out, acc, nodes, args) -> None:
    """Shapes, padding, and that the accepted path is a root-to-node path of the tree whose tokens were emitted."""
    out, acc, nodes = out.cpu(), acc.cpu(), nodes.cpu()
    cu = args["cu_num_nodes"].cpu().tolist()
    parents, tokens = args["node_parents"].cpu().tolist(), args["node_token_ids"].cpu().tolist()
    max_depth = args["max_depth"]
    assert out.shape == (len(cu) - 1, max_depth + 1) and nodes.shape == (len(cu) - 1, max_depth)
    assert acc.dtype == torch.int32 and nodes.dtype == torch.int32 and out.dtype == torch.int64
    for b in range(len(cu) - 1):
        n = int(acc[b])
        assert (out[b, : n + 1] >= 0).all() and (out[b, n + 1 :] == -1).all(), f"row {b}: {out[b].tolist()}"
        assert (nodes[b, n:] == -1).all()
        prev = 0
        for d in range(n):
            local = int(nodes[b, d])
            assert parents[cu[b] + local] == prev, f"row {b}: accepted nodes {nodes[b].tolist()} are not a path"
            assert out[b, d] == tokens[cu[b] + local]
            prev = local


def run_both(args, block_v=None):
    return tree_sample(**args, block_v=block_v), tree_sample_reference(**args)


def assert_same(kernel, reference) -> None:
    for name, k, r in zip(("tokens", "num_accepted", "accepted_nodes"), kernel, reference):
        assert torch.equal(k.cpu(), r.cpu()), f"{name}: kernel {k.tolist()} != reference {r.tolist()}"


# A ragged batch of every kind of request: roots without children, chains, bushy and deep trees.
SHAPES = [
    [-1],  # root only: a bonus-only round
    [-1, 0, 0, 0],  # root with three children
    [-1, 0, 1, 1, 0, 4, 0],  # depth 2 with branching
    [-1, 0, 1, 2, 3],  # a chain of 4
    [-1, 0, 1, 0, 3, 4, 3, 0, 7],  # mixed
]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(("vocab", "block_v"), [(37, None), (300, 64)], ids=["v37", "v300-chunks64"])
def test_kernel_matches_reference(device, vocab, block_v):
    gen = torch.Generator().manual_seed(vocab)
    trees = SHAPES * 3 + [random_parents(int(torch.randint(1, 10, (1,), generator=gen)), gen) for _ in range(6)]
    kinds = [("sampled", "onehot", "greedy")[i % 3] for i in range(len(trees))]
    args = random_tree_batch(trees, vocab, seed=vocab, kinds=kinds, device=device)
    kernel, reference = run_both(args, block_v)
    assert_same(kernel, reference)
    check_invariants(*kernel, args)
    # the batch exercises every path: acceptance of a later sibling, full rejection at a node with children, leaves
    acc, nodes = reference[1].cpu(), reference[2].cpu()
    later_sibling = [b for b, parents in enumerate(trees) for d in range(int(acc[b]))
                     if parents.index(parents[int(nodes[b, d])], 1) != int(nodes[b, d])]  # fmt: skip
    assert later_sibling, "no request accepted a non-first child"
    assert ((acc == 0) & torch.tensor([len(t) > 1 for t in trees])).any(), "no request rejected every root child"


@pytest.mark.parametrize("device", DEVICES)
def test_all_onehot_without_draft_probs(device):
    trees = SHAPES[1:] * 2
    args = random_tree_batch(trees, 29, seed=3, kinds=["onehot"] * len(trees), device=device)
    args["draft_probs"] = None
    kernel, reference = run_both(args, block_v=16)
    assert_same(kernel, reference)
    check_invariants(*kernel, args)


def chain_args(spec_args):
    """spec_sample's inputs as chain trees: node j + 1 is draft j, node j's q row is draft j's q (the last row, a
    leaf's, is never read); target rows and positions are the same layout."""
    cu = spec_args["cu_num_draft_tokens"].cpu().long()
    num_drafts = (cu[1:] - cu[:-1]).tolist()
    device = spec_args["target_probs"].device
    drafts, q = spec_args["draft_token_ids"], spec_args["draft_probs"]
    tokens, parents, q_rows = [], [], []
    for b, k in enumerate(num_drafts):
        tokens += [7] + drafts[cu[b] : cu[b + 1]].tolist()
        parents += list(range(-1, k))
        q_rows += [q[cu[b] : cu[b + 1]], torch.zeros_like(q[:1])]
    return {
        "node_token_ids": torch.tensor(tokens, dtype=torch.int64, device=device),
        "node_parents": torch.tensor(parents, dtype=torch.int32, device=device),
        "cu_num_nodes": make_cu([k + 1 for k in num_drafts], device),
        "draft_probs": torch.cat(q_rows).contiguous(),
        "target_probs": spec_args["target_probs"],
        "target_argmax": spec_args["target_argmax"],
        "is_greedy": spec_args["is_greedy"],
        "draft_is_onehot": spec_args["draft_is_onehot"],
        "seeds": spec_args["seeds"],
        "positions": spec_args["positions"],
        "max_depth": spec_args["max_num_draft_tokens"],
    }


def spec_batch(num_drafts: list[int], vocab: int, seed: int, device="cpu"):
    """spec_sample inputs with q close to p and sampled drafts drawn from q (every row kind mixed)."""
    gen = torch.Generator().manual_seed(seed)
    batch, total = len(num_drafts), sum(num_drafts)
    target_logits = 2.0 * torch.randn(total + batch, vocab, generator=gen)
    rows = torch.arange(batch).repeat_interleave(torch.tensor(num_drafts) + 1)
    j = torch.cat([torch.arange(k + 1) for k in num_drafts])
    has_draft = j < torch.tensor(num_drafts)[rows]
    draft_probs = torch.softmax(target_logits[has_draft] + 0.7 * torch.randn(total, vocab, generator=gen), -1)
    sampled = torch.multinomial(draft_probs, 1, generator=gen).squeeze(1)
    mode = target_logits[has_draft].argmax(-1)
    deterministic = torch.where(torch.rand(total, generator=gen) < 0.7, mode, torch.randint(0, vocab, (total,),
                                                                                            generator=gen))
    kinds = torch.randint(0, 3, (batch,), generator=gen)  # 0 sampled, 1 one-hot, 2 greedy
    args = {
        "draft_token_ids": torch.where(kinds[rows[has_draft]] > 0, deterministic, sampled),
        "cu_num_draft_tokens": make_cu(num_drafts),
        "draft_probs": draft_probs,
        "target_probs": torch.softmax(target_logits, -1),
        "target_argmax": target_logits.argmax(-1),
        "is_greedy": kinds == 2,
        "draft_is_onehot": kinds == 1,
        "seeds": torch.randint(-(2**63), 2**63 - 1, (batch,), generator=gen),
        "positions": torch.randint(0, 1 << 40, (batch,), generator=gen),
        "max_num_draft_tokens": max(num_drafts),
    }
    return to_device(args, device)


@pytest.mark.parametrize("device", DEVICES)
def test_chain_tree_equals_spec_sample(device):
    """A chain is a tree: same tokens and acceptance as spec_sample, bit for bit (reference and kernel)."""
    gen = torch.Generator().manual_seed(0)
    num_drafts = torch.randint(0, 7, (30,), generator=gen).tolist()
    spec = spec_batch(num_drafts, vocab=41, seed=1, device=device)
    tree = chain_args(spec)
    spec_out, spec_acc = spec_sample_reference(**spec)
    ref_out, ref_acc, ref_nodes = tree_sample_reference(**tree)
    assert torch.equal(ref_out, spec_out) and torch.equal(ref_acc, spec_acc)
    cols = torch.arange(tree["max_depth"], device=device)
    expected_nodes = torch.where(cols[None, :] < ref_acc[:, None], cols[None, :] + 1, -1).int()
    assert torch.equal(ref_nodes, expected_nodes)
    kernel = tree_sample(**tree, block_v=32)
    assert torch.equal(kernel[0], spec_sample(**spec, block_v=32)[0])
    assert_same(kernel, (ref_out, ref_acc, ref_nodes))
    k = torch.tensor(num_drafts)
    sampled = ~(spec["is_greedy"] | spec["draft_is_onehot"]).cpu()
    assert ((spec_acc.cpu() < k) & sampled).any() and ((spec_acc.cpu() == k) & sampled & (k > 0)).any()


def greedy_longest_path(parents, tokens, argmax) -> list[int]:
    """The longest root-to-node path whose every node is the target argmax of its parent's row (brute force)."""
    best: list[int] = []
    for leaf in range(len(parents)):
        path, node = [], leaf
        while node > 0:
            path.append(node)
            node = parents[node]
        path = path[::-1]
        prefix = []
        for n in path:
            if tokens[n] != argmax[parents[n]]:
                break
            prefix.append(n)
        if len(prefix) > len(best):
            best = prefix
    return best


@pytest.mark.parametrize("device", DEVICES)
def test_greedy_follows_argmax_child_and_takes_the_longest_accepted_path(device):
    gen = torch.Generator().manual_seed(5)
    trees = [random_parents(int(torch.randint(0, 12, (1,), generator=gen)), gen) for _ in range(24)]
    vocab = 6  # small: argmax children are common, so long greedy paths occur
    args = random_tree_batch(trees, vocab, seed=9, kinds=["greedy"] * len(trees), device=device)
    kernel, reference = run_both(args)
    assert_same(kernel, reference)
    check_invariants(*kernel, args)
    cu = args["cu_num_nodes"].cpu().tolist()
    tokens, argmax = args["node_token_ids"].cpu().tolist(), args["target_argmax"].cpu().tolist()
    out, acc, nodes = (t.cpu() for t in reference)
    longest = 0
    for b, parents in enumerate(trees):
        local_tokens, local_argmax = tokens[cu[b] : cu[b + 1]], argmax[cu[b] : cu[b + 1]]
        path = greedy_longest_path(parents, local_tokens, local_argmax)
        assert nodes[b, : len(path)].tolist() == path and int(acc[b]) == len(path)
        last = path[-1] if path else 0
        assert int(out[b, len(path)]) == local_argmax[last], "the emitted token is the argmax at the path's end"
        longest = max(longest, len(path))
    assert longest >= 2


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kind", ["sampled", "onehot", "greedy"])
def test_exact_onehot_target(device, kind):
    """With a one-hot target every kind must follow the target's token: the matching child at each node (a later
    sibling included) and the target's token where no child matches."""
    vocab = 8
    # tree: root -> {1: tok 3 -> {2: tok 4, 3: tok 5}, 4: tok 2 -> {5: tok 6}}, target path: 2 (node 4), 6 (node 5), 1
    parents = [-1, 0, 1, 1, 0, 4]
    tokens = [0, 3, 4, 5, 2, 6]
    target = [2, 5, 0, 0, 6, 1]  # the target's token at each node's row
    q = torch.full((len(tokens), vocab), 1.0 / vocab)  # uniform draft (sampled children have q > 0)
    args = {
        "node_token_ids": torch.tensor(tokens), "node_parents": torch.tensor(parents, dtype=torch.int32),
        "cu_num_nodes": make_cu([len(tokens)]), "draft_probs": q, "target_probs": onehot_probs(target, vocab),
        "target_argmax": torch.tensor(target), "is_greedy": torch.tensor([kind == "greedy"]),
        "draft_is_onehot": torch.tensor([kind == "onehot"]), "seeds": torch.tensor([123]),
        "positions": torch.tensor([10]), "max_depth": 2,
    }  # fmt: skip
    args = to_device(args, device)
    for result in run_both(args):
        out, acc, nodes = (t.cpu() for t in result)
        assert out.tolist() == [[2, 6, 1]] and acc.tolist() == [2] and nodes.tolist() == [[4, 5]], (
            out.tolist(), nodes.tolist())  # fmt: skip


@pytest.mark.parametrize("device", DEVICES)
def test_all_zero_residual_falls_back_to_p(device):
    """q = 2p at the root: children are rejected half the time and max(p - A q, 0) is all zero afterwards, so the
    emitted token must come from p (one-hot here)."""
    vocab, batch = 16, 12
    trees = [[-1, 0]] * batch
    target_tokens = [(3 * b) % vocab for b in range(batch) for _ in range(2)]
    p = onehot_probs(target_tokens, vocab)
    tokens = torch.tensor(target_tokens)  # each child is the target's token
    args = {
        "node_token_ids": tokens, "node_parents": torch.tensor([-1, 0] * batch, dtype=torch.int32),
        "cu_num_nodes": make_cu([2] * batch), "draft_probs": 2.0 * p, "target_probs": p,
        "target_argmax": tokens, "is_greedy": torch.zeros(batch, dtype=torch.bool),
        "draft_is_onehot": torch.zeros(batch, dtype=torch.bool), "seeds": torch.arange(batch) + 5,
        "positions": torch.zeros(batch, dtype=torch.int64), "max_depth": 1,
    }  # fmt: skip
    args = to_device(args, device)
    kernel, reference = run_both(args)
    assert_same(kernel, reference)
    out, acc = reference[0].cpu(), reference[1].cpu()
    assert (acc == 0).any() and (acc == 1).any(), trees
    for b in range(batch):
        assert int(out[b, int(acc[b])]) == target_tokens[2 * b]


@pytest.mark.parametrize("device", DEVICES)
def test_later_sibling_outside_the_draft_support(device):
    """A drafter error: q is one-hot at the first child, so the second child has q = 0 and no draft mass is left
    (M_2 = 0). Nothing may divide by zero or produce NaN: the second child is rejected, A stays finite, and the
    emitted token comes from the residual (kernel == reference, a token of p's support)."""
    vocab, batch = 12, 16
    parents = [-1, 0, 0]
    gen = torch.Generator().manual_seed(3)
    p = torch.softmax(torch.randn(3 * batch, vocab, generator=gen), -1)
    q = onehot_probs([0, 0, 0] * batch, vocab)  # the root's q: all mass on token 0
    args = {
        "node_token_ids": torch.tensor([5, 0, 1] * batch),
        "node_parents": torch.tensor(parents * batch, dtype=torch.int32),
        "cu_num_nodes": make_cu([3] * batch), "draft_probs": q, "target_probs": p, "target_argmax": p.argmax(-1),
        "is_greedy": torch.zeros(batch, dtype=torch.bool), "draft_is_onehot": torch.zeros(batch, dtype=torch.bool),
        "seeds": torch.arange(batch) * 31, "positions": torch.arange(batch) * 3, "max_depth": 1,
    }  # fmt: skip
    args = to_device(args, device)
    kernel, reference = run_both(args)
    assert_same(kernel, reference)
    out, acc, nodes = (t.cpu() for t in reference)
    assert (nodes[:, 0] != 2).all(), "a child with q = 0 and no draft mass left must not be accepted"
    assert (acc == 0).any() and ((out[:, 0] >= 0) & (out[:, 0] < vocab)).all()


@pytest.mark.parametrize("device", DEVICES)
def test_seeded_determinism_and_batch_independence(device):
    trees = SHAPES[1:] + SHAPES[1:]
    args = random_tree_batch(trees, 23, seed=4, kinds=["sampled", "onehot"] * 4, device=device)
    kernel = tree_sample(**args)
    assert_same(kernel, tree_sample(**args))
    cu = args["cu_num_nodes"].cpu().tolist()
    for b in (6, 1):  # a request alone gives the same tokens
        rows = torch.arange(cu[b], cu[b + 1], device=device)
        alone = {
            "node_token_ids": args["node_token_ids"][rows], "node_parents": args["node_parents"][rows],
            "cu_num_nodes": make_cu([len(rows)], device), "draft_probs": args["draft_probs"][rows],
            "target_probs": args["target_probs"][rows], "target_argmax": args["target_argmax"][rows],
            "max_depth": args["max_depth"],
            **{k: args[k][b : b + 1] for k in ("is_greedy", "draft_is_onehot", "seeds", "positions")},
        }  # fmt: skip
        out, acc, nodes = tree_sample(**alone)
        assert torch.equal(out[0], kernel[0][b]) and acc[0] == kernel[1][b] and torch.equal(nodes[0], kernel[2][b])


def test_ops_dispatch_matches_kernel():
    args = random_tree_batch(SHAPES, 19, seed=2, kinds=["sampled", "onehot", "greedy", "sampled", "onehot"])
    check_ops_dispatch(ops.tree_sample, args)


def test_empty_batch_and_roots_only():
    empty = torch.zeros(0, dtype=torch.int64)
    args = {
        "node_token_ids": empty, "node_parents": torch.zeros(0, dtype=torch.int32),
        "cu_num_nodes": torch.zeros(1, dtype=torch.int32), "draft_probs": torch.zeros(0, 8),
        "target_probs": torch.zeros(0, 8), "target_argmax": empty, "is_greedy": torch.zeros(0, dtype=torch.bool),
        "draft_is_onehot": torch.zeros(0, dtype=torch.bool), "seeds": empty, "positions": empty, "max_depth": 0,
    }  # fmt: skip
    for fn in (tree_sample, tree_sample_reference):
        out, acc, nodes = fn(**args)
        assert out.shape == (0, 1) and acc.shape == (0,) and nodes.shape == (0, 0)
    roots = random_tree_batch([[-1]] * 3, 8, seed=0, kinds=["sampled", "greedy", "onehot"])
    kernel, reference = run_both(roots)
    assert_same(kernel, reference)
    assert reference[0].shape == (3, 1) and reference[2].shape == (3, 0) and (reference[1] == 0).all()


def test_config():
    assert tree_sample_config(111).block_v == 128 and tree_sample_config(151936).block_v == 1024
    with pytest.raises(ValueError, match="vocab_size"):
        tree_sample_config(0)


def test_sampled_drafts_from_the_drafter_stream_are_distinct():
    """Gumbel-top-k over Philox STREAM_DRAFT noise (how a drafter draws siblings without replacement) gives
    distinct tokens, which the validation requires."""
    q = torch.softmax(torch.randn(4, 50, generator=torch.Generator().manual_seed(0)), -1)
    noise = row_exponentials(torch.arange(4), torch.zeros(4, dtype=torch.int64), STREAM_DRAFT, 50)
    top = (q / noise).topk(5, dim=-1).indices
    assert all(len(set(row)) == 5 for row in top.tolist())


def _set(tensor, index, value):
    tensor = tensor.clone()
    tensor[index] = value
    return tensor


# request 0: [-1, 0, 0, 0] (nodes 0-3), request 1: [-1, 0, 1, 1, 0, 4, 0] (nodes 4-10)
BAD_INPUTS = {
    "cu-int64": (lambda a: with_changes(a, cu_num_nodes=a["cu_num_nodes"].long()), "cu_num_nodes"),
    "tokens-int32": (lambda a: with_changes(a, node_token_ids=a["node_token_ids"].int()), "node_token_ids"),
    "parents-int64": (lambda a: with_changes(a, node_parents=a["node_parents"].long()), "node_parents"),
    **COMMON_BAD_INPUTS,  # includes "none-needs-onehot"
    "max-depth-negative": (lambda a: with_changes(a, max_depth=-1), "max_depth"),
    "max-depth-too-small": (lambda a: with_changes(a, max_depth=1), "max_depth"),
    "token-out-of-vocab": (lambda a: with_changes(a, node_token_ids=_set(a["node_token_ids"], 2, 10**6)),
                           "node_token_ids"),
    "root-parent": (lambda a: with_changes(a, node_parents=_set(a["node_parents"], 4, 0)), "root"),
    "parent-later-node": (lambda a: with_changes(a, node_parents=_set(a["node_parents"], 5, 3)), "earlier node"),
    "not-dfs": (lambda a: with_changes(a, node_parents=_set(a["node_parents"], 9, 1)), "DFS"),
    "sibling-tokens": (
        lambda a: with_changes(a, node_token_ids=_set(a["node_token_ids"], 2, int(a["node_token_ids"][1]))),
        "sibling",
    ),
    "cu-empty-request": (lambda a: with_changes(a, cu_num_nodes=torch.tensor([0, 0, 11], dtype=torch.int32)), "root"),
    "cu-wrong-total": (lambda a: with_changes(a, cu_num_nodes=torch.tensor([0, 4, 10], dtype=torch.int32)),
                       "cu_num_nodes"),
}


@pytest.mark.parametrize("case", list(BAD_INPUTS))
@pytest.mark.parametrize("fn", [tree_sample, tree_sample_reference], ids=["launcher", "reference"])
def test_validation_errors(fn, case):
    args = random_tree_batch([SHAPES[1], SHAPES[2]], 12, seed=5, kinds=["sampled", "sampled"])
    check_bad_input(fn, args, BAD_INPUTS, case)
