"""Fused token-tree verification: lossless stochastic (recursive rejection sampling) and greedy, one program per
request.

Layout (M = all nodes of all requests, B = requests; a request's tree as in ``specdec.drafters.tree``):

    node_token_ids   int64 [M]        request b owns rows cu[b]:cu[b+1]: its root (the last committed token, never
                                      read) then its n_b drafts in DFS order, siblings in the order they were drawn
    node_parents     int32 [M]        parent of each node as a LOCAL index within its request (root: -1)
    cu_num_nodes     int32 [B + 1]    cu[0] = 0, cu[b+1] - cu[b] >= 1 (a root), cu[B] = M
    draft_probs      fp32  [M, V]     row r = the draft's standardized q at node r: the distribution node r's children
                                      were drawn from, WITHOUT replacement (leaf rows never read), or None (all one-hot)
    target_probs     fp32  [M, V]     row r = standardized p at node r (the distribution of node r's children)
    target_argmax    int64 [M]        argmax of the raw (penalised) target logits per row (greedy requests)
    is_greedy        bool  [B]        temperature-0 request
    draft_is_onehot  bool  [B]        deterministic children (n-gram trie, top-k of a greedy draft): q_k = onehot(x_k)
    seeds, positions int64 [B]        request seed; absolute position of the depth-1 nodes
    max_depth        int              >= the deepest node of the batch (host int: no sync)
    -> output_token_ids int64 [B, max_depth + 1]  the accepted path's tokens, then one correction/bonus token, then -1
    -> num_accepted     int32 [B]                 accepted drafts (the row emits num_accepted + 1 tokens)
    -> accepted_nodes   int32 [B, max_depth]      local node ids of the accepted path, depth 1..num_accepted, then -1

Algorithm (SpecInfer, Miao et al. 2024; Recursive Speculative Decoding, Jeon et al. 2024; Stratos notes s2/2.1):
from the root, at the current node with target row p and children x_1..x_m (sibling order), set p_1 = p and for
k = 1..m accept x_k with probability min(1, p_k(x_k) / q_k(x_k)), where q_k is the distribution x_k was drawn from:
q with the earlier siblings removed and renormalised (sampled children), or onehot(x_k) (one-hot children). On
acceptance move to x_k and repeat; on rejection p_{k+1} = norm(max(p_k - q_k, 0)). With no child accepted (or at a
leaf) emit one token from the last p_k. Greedy requests follow the child equal to the node's target argmax and emit
the argmax at the first node without one (Stratos appendix A).

Randomness (the Philox contract, so a chain tree gives exactly ``spec_sample``'s tokens): the node at depth d sits
at position positions[b] + d - 1; the accept uniform of the child of sibling rank k - 1 at depth d is
philox(seed, positions[b] + d - 1, STREAM_ACCEPT, k - 1); the emitted token at depth n + 1 (n accepted) is
``argmax(residual / E)`` with E_v = -log(philox(seed, positions[b] + n, STREAM_RESIDUAL, v)).

The residual without a [V] scratch per sibling (proof). Keep p_k unnormalised: r_k with p_k = r_k / Z_k,
Z_k = sum_v r_k(v). Scaling does not change a normalised result, so norm(max(p_k - q_k, 0)) = norm(max(r_k - Z_k q_k,
0)) and r_{k+1} = max(r_k - Z_k q_k, 0) is a valid unnormalised residual. Sampled children: q_k = q [v not in X_{k-1}]
/ M_k with X_{k-1} = {x_1..x_{k-1}} and M_k = sum_{v not in X_{k-1}} q(v). Claim: r_k = max(p - A_k q, 0) off
X_{k-1} and 0 on X_{k-1}, with A_1 = 0 and A_{k+1} = A_k + Z_k / M_k. Induction: off X_k,
max(max(p - A_k q, 0) - (Z_k / M_k) q, 0) = max(p - A_{k+1} q, 0) because max(max(a, 0) - b, 0) = max(a - b, 0) for
b >= 0; on X_{k-1}, q_k = 0 so r_{k+1} = r_k = 0; at x_k, a rejection has positive probability only if
p_k(x_k) < q_k(x_k), i.e. r_k(x_k) < (Z_k / M_k) q(x_k), so r_{k+1}(x_k) = 0. One-hot children: q_k = onehot(x_k)
and r_k(x_k) <= Z_k, so r_{k+1} = r_k with x_k zeroed: r_k = p with X_{k-1} zeroed (A stays 0). So the running
residual is two scalars (A_k, and Z_k from a pass over the row) plus the list of rejected siblings - no [V] copy.
The accept test ``p_k(x) / q_k(x) > u`` becomes ``u * q(x) * Z_k < r_k(x) * M_k`` (one-hot: q(x) = M_k = 1): no
division. The first child has Z_1 = M_1 = 1 (p and q are standardized), so it needs no pass and its test is
``spec_sample``'s ``u * q(x) < p(x)`` bit for bit; later siblings cost one pass over the row each (sums only, no
noise). Zeroing X_{k-1} in the sampled case is exact math (those entries are 0 anyway); it is applied explicitly so
that rounding can never resurrect a rejected sibling. If the final residual is all zero (p_k <= q_k up to
rounding) the token is drawn from the node's p, as ``spec_sample`` does.

NOTE (exactness): kernel and reference use the same Philox uniforms, products, differences, quotients (round to
nearest) and comparisons; the kernel launches with fp fusion off so ``p - A * q`` is not contracted into an FMA on a
GPU. What may differ by an ulp: ``-log(u)`` (``torch.log`` vs ``tl.log``, as in spec_sample) and the sums Z_k, M_k
(a different summation order). Those flip a decision only when it ties to within an ulp - probability ~1e-7 per
later sibling - so the two agree token for token in practice. Later siblings need q_k(x_k) > 0: a drafter must not
branch into tokens outside the draft's remaining support (such a child is accepted iff p_k(x_k) > 0, as spec_sample
treats q(x) = 0). Z_k / M_k is capped at 1e30 (a remaining draft mass below 1e-30 of the residual) so A stays finite.

Over 300 lines because the Triton kernel, its launcher and its torch reference (the CPU path and the test oracle)
stay side by side, as every kernel's do.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch

from specdec.kernels._triton import tl, triton
from specdec.kernels.philox import STREAM_ACCEPT, STREAM_RESIDUAL, philox_uniform, philox_uniform_tl, row_exponentials
from specdec.kernels.spec_sample import (
    _finish_row,
    _noise_argmax_reduce,
    _noise_argmax_update,
    _request_prologue,
    check_tensors,
    with_block_v,
)

_STREAM_ACCEPT: tl.constexpr = tl.constexpr(STREAM_ACCEPT)
MAX_SIBLING_SCALE = 1e30  # cap on Z_k / M_k (module docstring)
_MAX_SIBLING_SCALE: tl.constexpr = tl.constexpr(MAX_SIBLING_SCALE)


@dataclass(frozen=True)
class TreeSampleConfig:
    """Launch settings of the kernel for one vocabulary size."""

    block_v: int  # vocabulary chunk of the residual passes (power of two)
    num_warps: int


def tree_sample_config(vocab_size: int) -> TreeSampleConfig:
    """Fixed heuristic (no autotune): chunks of up to 1024 tokens, 4 per thread; the passes loop over the row.

    NOTE: spec_sample's 2048-token chunks over 8 warps (8 elements per thread) spilled here on sm_90 (the tree
    walk keeps more scalars live); 1024 over 8 warps compiles without spills on sm_80 and sm_90
    (tests/kernels/test_gpu_compile_tree_sample.py).
    """
    if vocab_size < 1:
        raise ValueError(f"vocab_size must be >= 1, got {vocab_size}")
    block_v = min(triton.next_power_of_2(vocab_size), 1024)
    return TreeSampleConfig(block_v=block_v, num_warps=4 if block_v <= 512 else 8)


# ----------------------------------------------------------------------------------------------------- kernel


@triton.jit
def _residual_chunk(p_row_ptr, q_row_ptr, load_q, scale, excluded_ptr, num_excluded, offs, vocab_size):
    """One chunk of r = max(p - scale * q, 0) with the rejected siblings' tokens zeroed.

    Returns (r, q kept, in_vocab), each (BLOCK_V,); q = 0 unless ``load_q``.
    """
    in_vocab = offs < vocab_size
    p = tl.load(p_row_ptr + offs, mask=in_vocab, other=0.0)
    q = tl.load(q_row_ptr + offs, mask=tl.where(load_q, in_vocab, False), other=0.0)
    keep = in_vocab
    for j in range(0, num_excluded):  # the node's rejected children so far (a handful)
        keep = keep & (offs != tl.load(excluded_ptr + j))
    residual = tl.where(keep, tl.maximum(p - scale * q, 0.0), 0.0)
    return residual, tl.where(keep, q, 0.0), in_vocab


@triton.jit
def _residual_sums(p_row_ptr, q_row_ptr, load_q, scale, excluded_ptr, num_excluded, vocab_size,
                   BLOCK_V: tl.constexpr):  # fmt: skip
    """(Z, M) = (sum of the residual, sum of q off the rejected siblings), per-lane sums reduced once."""
    lanes = tl.arange(0, BLOCK_V)
    z = tl.zeros([BLOCK_V], tl.float32)
    m = tl.zeros([BLOCK_V], tl.float32)
    for start in range(0, vocab_size, BLOCK_V):
        residual, q, _ = _residual_chunk(p_row_ptr, q_row_ptr, load_q, scale, excluded_ptr, num_excluded,
                                         start + lanes, vocab_size)  # fmt: skip
        z += residual
        m += q
    return tl.sum(z, 0), tl.sum(m, 0)


@triton.jit
def _residual_argmax(p_row_ptr, q_row_ptr, load_q, scale, excluded_ptr, num_excluded, seed, position, vocab_size,
                     BLOCK_V: tl.constexpr):  # fmt: skip
    """(argmax_v r_v / E_v, max_v r_v), E_v = -log(philox(seed, position, STREAM_RESIDUAL, v)).

    Same per-lane running state and tie rule (lowest index) as spec_sample's ``_argmax_over_noise``.
    """
    lanes = tl.arange(0, BLOCK_V)
    best_score = tl.full([BLOCK_V], -1.0, tl.float32)  # below every real score (>= 0)
    best_index = lanes
    max_residual = tl.zeros([BLOCK_V], tl.float32)
    for start in range(0, vocab_size, BLOCK_V):
        offs = start + lanes
        residual, _, in_vocab = _residual_chunk(p_row_ptr, q_row_ptr, load_q, scale, excluded_ptr, num_excluded,
                                                offs, vocab_size)  # fmt: skip
        best_score, best_index, max_residual = _noise_argmax_update(
            residual, in_vocab, offs, seed, position, best_score, best_index, max_residual
        )
    return _noise_argmax_reduce(best_score, best_index, max_residual)


@triton.jit(do_not_specialize=["max_depth"])
def _tree_sample_kernel(
    out_ptr,  # int64 [B, max_depth + 1]
    num_accepted_ptr,  # int32 [B]
    accepted_nodes_ptr,  # int32 [B, max_depth]
    token_ids_ptr,  # int64 [M]
    parents_ptr,  # int32 [M] local parent index (root -1)
    cu_ptr,  # int32 [B + 1]
    draft_probs_ptr,  # fp32 [M, V] (any fp32 tensor when not HAS_DRAFT_PROBS; never read then)
    target_probs_ptr,  # fp32 [M, V]
    target_argmax_ptr,  # int64 [M]
    is_greedy_ptr,  # bool [B]
    onehot_ptr,  # bool [B]
    seeds_ptr,  # int64 [B]
    positions_ptr,  # int64 [B]
    excluded_ptr,  # int64 [M] workspace: request b's rejected children of its current node, at cu[b]...
    max_depth,
    vocab_size,
    HAS_DRAFT_PROBS: tl.constexpr,
    BLOCK_V: tl.constexpr,
    BLOCK_D: tl.constexpr,  # >= max_depth + 1 (padding stores)
):
    req, base, num_nodes, greedy, onehot, seed, position = _request_prologue(
        cu_ptr, is_greedy_ptr, onehot_ptr, seeds_ptr, positions_ptr, HAS_DRAFT_PROBS
    )
    load_q = not onehot
    out_row_ptr = out_ptr + req * (max_depth + 1)
    path_row_ptr = accepted_nodes_ptr + req * max_depth
    excluded_row_ptr = excluded_ptr + base

    # One forward scan over the nodes in DFS order (a while loop with flags: no `break` on GPUs). A node's children
    # are the later nodes whose parent is it; the scan leaves its subtree at the first node whose parent is an
    # earlier node. After accepting child i the scan goes on at i + 1, the first node of i's subtree.
    zero = base * 0
    node = zero  # local index of the current node (its depth = number accepted)
    depth = zero
    rank = zero  # sibling rank of the next child of `node` = number of its children rejected so far
    scale = zero.to(tl.float32)  # A_k
    z = scale + 1.0  # Z_k (1 for the first child)
    m = scale + 1.0  # M_k (1 for the first child; 1 for one-hot children)
    node_argmax = tl.load(target_argmax_ptr + base)
    i = zero + 1
    scanning = (num_nodes > 1) & (max_depth > 0)
    while scanning:
        parent = tl.load(parents_ptr + base + i).to(tl.int64)
        left_subtree = parent < node
        if parent == node:
            x = tl.load(token_ids_ptr + base + i)
            if greedy:
                ok = x == node_argmax
            else:
                row = base + node
                p_row_ptr = target_probs_ptr + row * vocab_size
                q_row_ptr = draft_probs_ptr + row * vocab_size
                if rank > 0:
                    z, m = _residual_sums(p_row_ptr, q_row_ptr, load_q, scale, excluded_row_ptr, rank, vocab_size,
                                          BLOCK_V)  # fmt: skip
                    m = tl.where(onehot, 1.0, m)
                in_vocab = (x >= 0) & (x < vocab_size)
                p_x = tl.load(p_row_ptr + x, mask=in_vocab, other=0.0)
                q_x = tl.load(q_row_ptr + x, mask=in_vocab & load_q, other=0.0)
                r_x = tl.maximum(p_x - scale * q_x, 0.0)
                q_test = tl.where(onehot, 1.0, q_x)
                u = philox_uniform_tl(seed, position + depth, _STREAM_ACCEPT, rank)  # in (0, 1)
                ok = u * q_test * z < r_x * m  # u < p_k(x) / q_k(x) without dividing
            if ok:
                tl.store(out_row_ptr + depth, x)
                tl.store(path_row_ptr + depth, i.to(tl.int32))
                depth += 1
                node = i
                rank = zero
                scale = scale * 0.0  # finite (capped), so exactly 0
                z = scale + 1.0
                m = scale + 1.0
                node_argmax = tl.load(target_argmax_ptr + base + i)
            else:
                tl.store(excluded_row_ptr + rank, x)
                tl.debug_barrier()  # the next pass's threads read what this store wrote
                step = tl.minimum(tl.where(m > 0.0, tl.math.div_rn(z, tl.where(m > 0.0, m, 1.0)), 0.0),
                                  _MAX_SIBLING_SCALE)  # fmt: skip
                scale = tl.where(onehot | greedy, scale, scale + step)
                rank += 1
        i += 1
        scanning = (i < num_nodes) & (not left_subtree) & (depth < max_depth)

    # One more token at depth + 1: from the residual after the node's rejected children, or the bonus at a leaf.
    token = node_argmax
    if not greedy:
        row = base + node
        p_row_ptr = target_probs_ptr + row * vocab_size
        q_row_ptr = draft_probs_ptr + row * vocab_size
        # At most two passes through ONE copy of the loop (a second copy raised register pressure into spills):
        # the residual, then p itself if the residual is all zero (p_k <= q_k up to rounding).
        from_residual = rank >= 0  # True
        searching = from_residual
        sampled = zero.to(tl.int32)
        while searching:
            sampled, max_residual = _residual_argmax(
                p_row_ptr, q_row_ptr, load_q & (rank > 0) & from_residual, tl.where(from_residual, scale, 0.0),
                excluded_row_ptr, tl.where(from_residual, rank, 0), seed, position + depth, vocab_size, BLOCK_V,
            )  # fmt: skip
            searching = from_residual & (max_residual <= 0.0)
            from_residual = from_residual & False
        token = sampled.to(tl.int64)
    _finish_row(out_row_ptr, num_accepted_ptr, req, depth, token, max_depth, BLOCK_D)
    cols = tl.arange(0, BLOCK_D)
    tl.store(path_row_ptr + cols, tl.full([BLOCK_D], -1, tl.int32), mask=(cols >= depth) & (cols < max_depth))


def tree_sample(
    node_token_ids: torch.Tensor,
    node_parents: torch.Tensor,
    cu_num_nodes: torch.Tensor,
    draft_probs: torch.Tensor | None,
    target_probs: torch.Tensor,
    target_argmax: torch.Tensor,
    is_greedy: torch.Tensor,
    draft_is_onehot: torch.Tensor,
    seeds: torch.Tensor,
    positions: torch.Tensor,
    max_depth: int,
    *,
    block_v: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Fused verification of a batch of draft trees (Triton); layout and algorithm in the module docstring.

    Args:
        node_token_ids: int64 ``[M]``; node_parents: int32 ``[M]`` (local, root -1); cu_num_nodes: int32 ``[B + 1]``.
        draft_probs: fp32 ``[M, V]``, or None when every request is one-hot.
        target_probs: fp32 ``[M, V]``; target_argmax: int64 ``[M]``.
        is_greedy, draft_is_onehot: bool ``[B]``; seeds, positions: int64 ``[B]``.
        max_depth: >= every node's depth (a host int, so the launcher never syncs).
        block_v: override of the vocabulary chunk (tests cover several chunks on a small vocabulary).
    Returns:
        output_token_ids int64 ``[B, max_depth + 1]``, num_accepted int32 ``[B]``, accepted_nodes int32
        ``[B, max_depth]`` (-1 padded).

    Allocates an int64 ``[M]`` workspace (each request's rejected siblings of its current node). On CUDA the
    metadata values are trusted (reading them would sync); the kernel still never writes outside its rows.
    """
    _check_inputs(node_token_ids, node_parents, cu_num_nodes, draft_probs, target_probs, target_argmax, is_greedy,
                  draft_is_onehot, seeds, positions, max_depth)  # fmt: skip
    if not target_probs.is_cuda:
        _tree_links(node_token_ids, node_parents, cu_num_nodes, draft_probs, draft_is_onehot, target_probs.shape[1],
                    max_depth)  # fmt: skip
    batch, vocab, device = seeds.shape[0], target_probs.shape[1], target_probs.device
    out = torch.empty((batch, max_depth + 1), dtype=torch.int64, device=device)
    num_accepted = torch.empty(batch, dtype=torch.int32, device=device)
    accepted_nodes = torch.empty((batch, max_depth), dtype=torch.int32, device=device)
    if batch == 0:
        return out, num_accepted, accepted_nodes
    config = with_block_v(tree_sample_config(vocab), block_v)
    excluded = torch.empty(node_token_ids.shape[0], dtype=torch.int64, device=device)
    _tree_sample_kernel[(batch,)](
        out, num_accepted, accepted_nodes, node_token_ids, node_parents, cu_num_nodes,
        target_probs if draft_probs is None else draft_probs, target_probs, target_argmax, is_greedy,
        draft_is_onehot, seeds, positions, excluded, max_depth, vocab,
        HAS_DRAFT_PROBS=draft_probs is not None, BLOCK_V=config.block_v,
        BLOCK_D=triton.next_power_of_2(max_depth + 1), num_warps=config.num_warps, enable_fp_fusion=False,
    )  # fmt: skip
    return out, num_accepted, accepted_nodes


# -------------------------------------------------------------------------------------------------- reference


def accept_uniforms(seeds: torch.Tensor, positions: torch.Tensor, depth: torch.Tensor, rank: torch.Tensor):
    """Every node's accept uniform in one Philox call (fp32 ``[M]``; the roots' entries are unused): the node at
    depth d with sibling rank k - 1 draws philox(seed, position + d - 1, STREAM_ACCEPT, k - 1). All int64 ``[M]``
    (each node's request seed and depth-1 position); a named step so tests can plant a wrongly keyed mutant."""
    return philox_uniform(seeds, positions + (depth - 1).clamp(min=0), STREAM_ACCEPT, rank)


def remaining_draft_mass(q: torch.Tensor, excluded: torch.Tensor) -> torch.Tensor:
    """M_k = sum of q off the rejected siblings: fp32 ``[R]`` from q ``[R, V]`` and excluded bool ``[R, V]``
    (a named step so tests can plant the "q_k not renormalised" mutant in it)."""
    return torch.where(excluded, 0.0, q).sum(dim=-1)


def reject_sibling(
    scale: torch.Tensor, excluded: torch.Tensor, token: torch.Tensor, step: torch.Tensor, onehot: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The residual update after rejecting ``token`` (int64 ``[R]``): A += Z_k / M_k (``step`` fp32 ``[R]``; sampled
    rows only) and the token joins the rejected siblings (``excluded`` int64 ``[R, S]``, -1 padded, in order).
    Returns the new (scale, excluded); a named step so tests can plant the "residual not updated" mutants in it."""
    scale = torch.where(onehot, scale, scale + step)
    slot = (excluded >= 0).sum(dim=-1, keepdim=True)  # (R, 1) first free slot (< S: a node has <= S children)
    return scale, excluded.scatter(1, slot, token[:, None])


def residual_rows(p: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, excluded: torch.Tensor) -> torch.Tensor:
    """r = max(p - A q, 0) with the excluded tokens zeroed: fp32 ``[R, V]`` (``scale`` A: fp32 ``[R]``,
    ``excluded`` bool ``[R, V]``)."""
    return torch.where(excluded, 0.0, torch.clamp(p - scale[:, None] * q, min=0.0))


def _excluded_mask(tokens: torch.Tensor, vocab: int) -> torch.Tensor:
    """bool ``[R, V]`` from the rejected siblings' tokens int64 ``[R, S]`` (-1 padded)."""
    mask = torch.zeros(tokens.shape[0], vocab + 1, dtype=torch.bool, device=tokens.device)
    mask.scatter_(1, torch.where(tokens >= 0, tokens, vocab), True)  # padding lands in the spare column
    return mask[:, :vocab]


def tree_sample_reference(
    node_token_ids: torch.Tensor,
    node_parents: torch.Tensor,
    cu_num_nodes: torch.Tensor,
    draft_probs: torch.Tensor | None,
    target_probs: torch.Tensor,
    target_argmax: torch.Tensor,
    is_greedy: torch.Tensor,
    draft_is_onehot: torch.Tensor,
    seeds: torch.Tensor,
    positions: torch.Tensor,
    max_depth: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Torch reference (the CPU path and the test oracle) of :func:`tree_sample`; same arguments and outputs.

    Vectorised over requests: each iteration tests one child per unfinished request (or finishes it), so the loop
    runs at most max_b(n_b) times; rows of the vocabulary are read only for the sums of later siblings and for the
    final draw. Raises ``ValueError`` on bad shapes/dtypes and bad metadata values.
    """
    _check_inputs(node_token_ids, node_parents, cu_num_nodes, draft_probs, target_probs, target_argmax, is_greedy,
                  draft_is_onehot, seeds, positions, max_depth)  # fmt: skip
    links = _tree_links(node_token_ids, node_parents, cu_num_nodes, draft_probs, draft_is_onehot,
                        target_probs.shape[1], max_depth)  # fmt: skip
    device = target_probs.device
    first_child, next_sibling = links.first_child.to(device), links.next_sibling.to(device)
    batch, vocab = seeds.shape[0], target_probs.shape[1]
    request = torch.repeat_interleave(torch.arange(batch, device=device), (cu_num_nodes[1:] - cu_num_nodes[:-1]).long())
    node_u = accept_uniforms(seeds[request], positions[request], links.depth.to(device), links.rank.to(device))
    sampled_q = ~is_greedy & (torch.zeros_like(is_greedy) if draft_probs is None else ~draft_is_onehot)  # (B,)
    base = cu_num_nodes[:-1].long()  # (B,) global index of each root
    node = base.clone()  # (B,) global index of the current node
    child = first_child[node]  # (B,) global index of the next child to test, -1: none left
    rank = torch.zeros(batch, dtype=torch.int64, device=device)  # children of `node` rejected so far
    depth = torch.zeros(batch, dtype=torch.int64, device=device)
    scale = torch.zeros(batch, dtype=torch.float32, device=device)  # A_k
    # the rejected children of `node` (tokens, -1 padded)
    excluded = torch.full((batch, max(links.max_children, 1)), -1, dtype=torch.int64, device=device)
    out = torch.full((batch, max_depth + 1), -1, dtype=torch.int64, device=device)
    accepted_nodes = torch.full((batch, max_depth), -1, dtype=torch.int32, device=device)

    while True:
        rows = ((child >= 0) & (depth < max_depth)).nonzero().squeeze(1)  # (R,) requests with a child to test
        if rows.numel() == 0:
            break
        cand, nd, k, a = child[rows], node[rows], rank[rows], scale[rows]
        x = node_token_ids[cand]  # (R,)
        greedy, has_q = is_greedy[rows], sampled_q[rows]
        z = torch.ones_like(a)  # Z_k (Z_1 = 1)
        m = torch.ones_like(a)  # M_k (M_1 = 1; 1 for one-hot children)
        later = ((k > 0) & ~greedy).nonzero().squeeze(1)  # rows that need the sums over their row
        if later.numel():
            p = target_probs[nd[later]]  # (L, V)
            q = torch.zeros_like(p) if draft_probs is None else _rows_where(draft_probs, nd[later], has_q[later])
            ex = _excluded_mask(excluded[rows[later]], vocab)
            z[later] = residual_rows(p, q, a[later], ex).sum(dim=-1)
            m[later] = torch.where(has_q[later], remaining_draft_mass(q, ex), 1.0)
        p_x = target_probs[nd, x]
        q_x = torch.zeros_like(p_x) if draft_probs is None else torch.where(has_q, draft_probs[nd, x], 0.0)
        r_x = torch.clamp(p_x - a * q_x, min=0.0)
        q_test = torch.where(has_q, q_x, 1.0)
        u = node_u[cand]  # (R,)
        ok = torch.where(greedy, target_argmax[nd] == x, u * q_test * z < r_x * m)

        acc, rej = rows[ok], rows[~ok]
        out[acc, depth[acc]] = x[ok]
        accepted_nodes[acc, depth[acc]] = (cand[ok] - base[acc]).to(torch.int32)
        depth[acc] += 1
        node[acc] = cand[ok]
        child[acc] = first_child[cand[ok]]
        rank[acc] = 0
        scale[acc] = 0.0
        excluded[acc] = -1

        step = torch.where(m > 0, z / torch.where(m > 0, m, 1.0), 0.0).clamp(max=MAX_SIBLING_SCALE)
        scale[rej], excluded[rej] = reject_sibling(a[~ok], excluded[rej], x[~ok], step[~ok], ~has_q[~ok])
        child[rej] = next_sibling[cand[~ok]]
        rank[rej] += 1

    # One more token per sampled request: the residual after the node's rejected children, or the bonus at a leaf.
    token = target_argmax[node].clone()  # greedy requests keep the target's argmax
    sampled = (~is_greedy).nonzero().squeeze(1)  # (S,)
    nd = node[sampled]
    p = target_probs[nd]  # (S, V)
    q = torch.zeros_like(p)
    if draft_probs is not None:
        q = _rows_where(draft_probs, nd, (rank[sampled] > 0) & sampled_q[sampled])
    residual = residual_rows(p, q, scale[sampled], _excluded_mask(excluded[sampled], vocab))
    dist = torch.where((residual > 0).any(dim=-1, keepdim=True), residual, p)  # all-zero residual: sample from p
    noise = row_exponentials(seeds[sampled], positions[sampled] + depth[sampled], STREAM_RESIDUAL, vocab)
    token[sampled] = (dist / noise.to(device)).argmax(dim=-1)
    out.scatter_(1, depth[:, None], token[:, None])
    return out, depth.to(torch.int32), accepted_nodes


def _rows_where(probs: torch.Tensor, nodes: torch.Tensor, use: torch.Tensor) -> torch.Tensor:
    """fp32 ``[R, V]``: row ``nodes[i]`` of ``probs`` where ``use[i]``, zeros elsewhere."""
    return torch.where(use[:, None], probs[nodes], 0.0)


# ------------------------------------------------------------------------------------------------- validation


def _check_inputs(
    node_token_ids, node_parents, cu_num_nodes, draft_probs, target_probs, target_argmax, is_greedy, draft_is_onehot,
    seeds, positions, max_depth,
) -> None:  # fmt: skip
    """Shapes, dtypes, devices and contiguity (no value reads: this runs on the GPU path too)."""
    if not isinstance(max_depth, int) or isinstance(max_depth, bool) or max_depth < 0:
        raise ValueError(f"max_depth must be an int >= 0, got {max_depth!r}")
    if target_probs.ndim != 2:
        raise ValueError(f"target_probs must be [M, V], got shape {tuple(target_probs.shape)}")
    if cu_num_nodes.ndim != 1 or cu_num_nodes.shape[0] < 1:
        raise ValueError(f"cu_num_nodes must be [B + 1], got shape {tuple(cu_num_nodes.shape)}")
    num_nodes, batch, vocab = node_token_ids.shape[0], cu_num_nodes.shape[0] - 1, target_probs.shape[1]
    expected = {
        "node_token_ids": (node_token_ids, torch.int64, (num_nodes,)),
        "node_parents": (node_parents, torch.int32, (num_nodes,)),
        "cu_num_nodes": (cu_num_nodes, torch.int32, (batch + 1,)),
        "target_probs": (target_probs, torch.float32, (num_nodes, vocab)),
        "target_argmax": (target_argmax, torch.int64, (num_nodes,)),
        "is_greedy": (is_greedy, torch.bool, (batch,)),
        "draft_is_onehot": (draft_is_onehot, torch.bool, (batch,)),
        "seeds": (seeds, torch.int64, (batch,)),
        "positions": (positions, torch.int64, (batch,)),
    }
    if draft_probs is not None:
        expected["draft_probs"] = (draft_probs, torch.float32, (num_nodes, vocab))
    check_tensors(expected, target_probs, f"M={num_nodes}, B={batch}, V={vocab}")


class _Links(NamedTuple):
    """Tree links of every node (global indices, -1 where there is none; int64 ``[M]`` CPU tensors)."""

    first_child: torch.Tensor
    next_sibling: torch.Tensor
    depth: torch.Tensor  # root 0
    rank: torch.Tensor  # sibling rank (0 for a first child and for roots)
    max_children: int  # the most children of any node


def _tree_links(
    node_token_ids, node_parents, cu_num_nodes, draft_probs, draft_is_onehot, vocab: int, max_depth: int
) -> _Links:
    """Check the metadata values (reads them: a host sync on CUDA, so the CUDA launcher skips it) and return
    the tree links (:class:`_Links`).

    Each request must be a rooted tree in DFS order (``specdec.drafters.tree.check_tree``'s rules), with drafted
    tokens in [0, V), distinct tokens among siblings and no node deeper than ``max_depth``.
    """
    if draft_probs is None and not bool(draft_is_onehot.all()):
        raise ValueError("draft_probs=None needs every request to be one-hot (draft_is_onehot all True)")
    tokens, parents, cu = node_token_ids.tolist(), node_parents.tolist(), cu_num_nodes.tolist()
    num_nodes = len(tokens)
    if cu[0] != 0 or cu[-1] != num_nodes or any(b - a < 1 for a, b in zip(cu, cu[1:])):
        raise ValueError("cu_num_nodes must start at 0, grow by >= 1 per request (every tree has a root) and end at "
                         f"len(node_token_ids) = {num_nodes}; got {cu}")  # fmt: skip
    first_child, next_sibling, max_children = [-1] * num_nodes, [-1] * num_nodes, 0
    depth, rank = [0] * num_nodes, [0] * num_nodes
    for b in range(len(cu) - 1):
        base, n = cu[b], cu[b + 1] - cu[b]
        if parents[base] != -1:
            raise ValueError(f"request {b}: node 0 is the root and must have parent -1, got {parents[base]}")
        path = [0]  # local nodes from the root to the previous node
        last_child: dict[int, int] = {}
        num_children: dict[int, int] = {}
        sibling_tokens: set[tuple[int, int]] = set()
        for i in range(1, n):
            parent, token = parents[base + i], tokens[base + i]
            if not 0 <= parent < i:
                raise ValueError(f"request {b}: node_parents[{i}] = {parent}; a parent must be an earlier node "
                                 f"(local index in [0, {i}))")  # fmt: skip
            while path and path[-1] != parent:
                path.pop()
            if not path:
                raise ValueError(f"request {b}: nodes are not in DFS order (node {i}'s parent {parent} is not on the "
                                 f"path to node {i - 1})")  # fmt: skip
            path.append(i)
            if len(path) - 1 > max_depth:
                raise ValueError(f"request {b}: node {i} has depth {len(path) - 1} > max_depth={max_depth}")
            if not 0 <= token < vocab:
                raise ValueError(f"request {b}: node_token_ids[{i}] = {token} must lie in [0, {vocab})")
            if (parent, token) in sibling_tokens:
                raise ValueError(f"request {b}: node {i} repeats the token {token} of an earlier sibling")
            sibling_tokens.add((parent, token))
            if parent in last_child:
                next_sibling[base + last_child[parent]] = base + i
            else:
                first_child[base + parent] = base + i
            last_child[parent] = i
            rank[base + i] = num_children.get(parent, 0)
            depth[base + i] = len(path) - 1
            num_children[parent] = rank[base + i] + 1
            max_children = max(max_children, num_children[parent])
    as_tensor = lambda values: torch.tensor(values, dtype=torch.int64)  # noqa: E731
    return _Links(as_tensor(first_child), as_tensor(next_sibling), as_tensor(depth), as_tensor(rank), max_children)
