"""Torch reference of paged attention: the test oracle of the Triton kernel and the CPU path of the engine.

Same contract as ``paged_attention`` (docs/architecture.md). Sequences whose new-token count is at most
``WINDOW_BATCH_MAX_Q`` (decodes, verification windows, small tree windows) are attended in one padded SDPA
call: their queries are padded to ``[n, Hq, Qmax, D]``, their K/V gathered through the block tables to
``[n, Hkv, Lmax, D]`` and a boolean ``[n, 1, Qmax, Lmax]`` mask encodes context length, causality or the tree
(a sequence with an empty tree-mask slice is causal).
Longer ones (prefill chunks) get one SDPA call each, so a prefill never pads a batch of decodes. All inputs are
4-D so that torch picks its fused CPU flash kernel rather than the math fallback (measured on SmolLM2, 5-token
windows: the math path with GQA expansion was ~23% of the forward).

The masks and row maps depend only on the batch metadata, which every layer of one forward shares: the last
plan is memoised on the metadata tensors' identity and version (``Tensor._version`` changes on in-place writes).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.nn.functional import scaled_dot_product_attention

WINDOW_BATCH_MAX_Q = 16  # sequences with <= this many new tokens share one padded SDPA call


def paged_attention_reference(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    cu_q_lens: torch.Tensor,
    scale: float,
    tree_mask: torch.Tensor | None = None,
    tree_mask_indptr: torch.Tensor | None = None,
) -> torch.Tensor:
    """Torch reference (and CPU path) of paged attention.

    Args:
        q: ``[T, Hq, D]`` queries of all new tokens of all sequences, flattened (fp32/fp16/bf16).
        k_cache, v_cache: ``[num_blocks, block_size, Hkv, D]``; the new tokens' K/V are already written.
        block_tables: int32 ``[B, max_blocks]``, physical block ids in logical order.
        seq_lens: int32 ``[B]`` context length per sequence, new tokens included.
        cu_q_lens: int32 ``[B+1]`` cumulative new-token counts; sequence b owns q rows
            ``cu_q_lens[b]:cu_q_lens[b+1]``, which are its last ``q_len`` context positions.
        scale: softmax scale, usually ``D ** -0.5``.
        tree_mask: optional bool/uint8 packed per-sequence masks, row-major ``[q_len, w]`` each over the sequence's
            last ``w >= q_len`` keys: new token i sees key ``seq_len - w + j`` iff ``mask[i, j]``, and always the
            context before them. Without it the new tokens are causal.
        tree_mask_indptr: int32 ``[B+1]`` offsets of each sequence's mask in ``tree_mask``. A sequence's slice
            ``tree_mask[indptr[b]:indptr[b+1]]`` is either empty - that sequence is causal, as without a mask
            (prefill chunks, chains, decodes in a tree batch) - or ``q_len_b * w_b`` entries,
            ``q_len_b <= w_b <= seq_len_b``.
    Returns:
        ``[T, Hq, D]`` in q's dtype (computed in fp32).
    """
    plan = _plan(block_tables, seq_lens, cu_q_lens, tree_mask, tree_mask_indptr, k_cache.shape[1])
    out = torch.empty_like(q)
    if plan.window is not None:
        _attend_windows(out, q, k_cache, v_cache, plan.window, scale)
    for seq in plan.long_sequences:
        _attend_one(out, q, k_cache, v_cache, seq, scale)
    return out


# ---------------------------------------------------------------------------------------------- the plan


@dataclass
class _Windows:
    """Padded batch of the short sequences (n of them, Qmax queries, Lmax keys)."""

    rows: torch.Tensor | None  # int64 [t] rows of q they own (None: all rows, in order)
    seq_of_row: torch.Tensor  # int64 [t] index in 0..n-1 of each row's sequence
    pos_in_seq: torch.Tensor  # int64 [t] index in 0..Qmax-1 of each row within its sequence
    blocks: torch.Tensor  # int64 [n, nb] physical blocks to gather (block 0 past a sequence's end)
    max_len: int  # Lmax
    max_q: int  # Qmax
    visible: torch.Tensor  # bool [n, 1, Qmax, Lmax]


@dataclass
class _LongSequence:
    rows: slice  # its q rows
    slots: torch.Tensor  # int64 [ctx] flat cache slots of its context, in order
    visible: torch.Tensor  # bool [1, 1, q_len, ctx]


@dataclass
class _Plan:
    window: _Windows | None
    long_sequences: list[_LongSequence]


_memo: tuple[tuple, tuple, int, _Plan] | None = None  # (tensors, their versions, block_size, plan) of the last call


def _plan(block_tables, seq_lens, cu_q_lens, tree_mask, tree_mask_indptr, block_size: int) -> _Plan:
    global _memo
    tensors = (block_tables, seq_lens, cu_q_lens, tree_mask, tree_mask_indptr)
    versions = tuple(None if t is None else t._version for t in tensors)
    if (_memo is not None and _memo[1] == versions and _memo[2] == block_size
            and all(a is b for a, b in zip(_memo[0], tensors, strict=True))):
        return _memo[3]
    plan = _build_plan(block_tables, seq_lens, cu_q_lens, tree_mask, tree_mask_indptr, block_size)
    _memo = (tensors, versions, block_size, plan)
    return plan


def _build_plan(block_tables, seq_lens, cu_q_lens, tree_mask, tree_mask_indptr, block_size: int) -> _Plan:
    device = block_tables.device
    seq_lens_l = seq_lens.tolist()
    cu = cu_q_lens.tolist()
    q_lens = [cu[b + 1] - cu[b] for b in range(len(seq_lens_l))]
    short = [b for b, n in enumerate(q_lens) if 0 < n <= WINDOW_BATCH_MAX_Q]
    long = [b for b, n in enumerate(q_lens) if n > WINDOW_BATCH_MAX_Q]
    window = _window_plan(short, q_lens, cu, seq_lens_l, block_tables, tree_mask, tree_mask_indptr, block_size,
                          device) if short else None
    long_sequences = []
    for b in long:
        ctx, n = seq_lens_l[b], q_lens[b]
        num_blocks = -(-ctx // block_size)
        blocks = block_tables[b, :num_blocks].long()
        slots = (blocks[:, None] * block_size + torch.arange(block_size, device=device)).flatten()[:ctx]
        visible = _causal_or_tree(b, n, ctx, tree_mask, tree_mask_indptr, device)
        long_sequences.append(_LongSequence(slice(cu[b], cu[b + 1]), slots, visible[None, None]))
    return _Plan(window, long_sequences)


def _window_plan(seqs, q_lens, cu, seq_lens_l, block_tables, tree_mask, tree_mask_indptr, block_size,
                 device) -> _Windows:
    n = len(seqs)
    lens = [seq_lens_l[b] for b in seqs]
    qls = [q_lens[b] for b in seqs]
    max_len, max_q = max(lens), max(qls)
    num_blocks = -(-max_len // block_size)
    lens_t = torch.tensor(lens, device=device)  # int64 [n]
    qls_t = torch.tensor(qls, device=device)  # int64 [n]
    blocks = block_tables[torch.tensor(seqs, device=device), :num_blocks].long()  # [n, nb]
    used = torch.arange(num_blocks, device=device)[None, :] * block_size < lens_t[:, None]
    blocks = torch.where(used, blocks, 0)  # entries past a sequence's end may hold anything: read block 0, masked
    all_rows = len(seqs) == len(q_lens) and all(x > 0 for x in q_lens)
    rows = None if all_rows else torch.cat([torch.arange(cu[b], cu[b + 1], device=device) for b in seqs])
    seq_of_row = torch.repeat_interleave(torch.arange(n, device=device), qls_t)  # [t]
    starts = torch.cumsum(qls_t, 0) - qls_t  # [n]
    pos_in_seq = torch.arange(int(qls_t.sum()), device=device) - starts[seq_of_row]  # [t]
    # Query i of sequence j sits at absolute position lens[j] - qls[j] + i; padded rows (i >= qls[j]) see
    # positions beyond the context, which are discarded - they only keep every softmax row non-empty.
    query_pos = lens_t[:, None] - qls_t[:, None] + torch.arange(max_q, device=device)[None, :]  # [n, Qmax]
    visible = torch.arange(max_len, device=device)[None, None, :] <= query_pos[:, :, None]  # [n, Qmax, Lmax]
    if tree_mask is not None:
        indptr = tree_mask_indptr.tolist()
        for j, b in enumerate(seqs):
            ql, m0 = qls[j], indptr[b]
            if indptr[b + 1] > m0:  # an empty slice keeps the causal rows built above
                w = (indptr[b + 1] - m0) // ql  # the mask covers the last w keys
                visible[j, :ql, lens[j] - w : lens[j]] = tree_mask[m0 : m0 + ql * w].view(ql, w).bool()
    return _Windows(rows, seq_of_row, pos_in_seq, blocks, max_len, max_q, visible[:, None])


def _causal_or_tree(b, q_len, ctx, tree_mask, tree_mask_indptr, device) -> torch.Tensor:
    """bool [q_len, ctx]: which context positions each of sequence b's new tokens sees (causal without a mask or
    with an empty mask slice)."""
    prefix = ctx - q_len
    visible = torch.ones(q_len, ctx, dtype=torch.bool, device=device)
    m0 = int(tree_mask_indptr[b]) if tree_mask is not None else 0
    if tree_mask is not None and int(tree_mask_indptr[b + 1]) > m0:
        w = (int(tree_mask_indptr[b + 1]) - m0) // q_len  # the mask covers the last w keys
        visible[:, ctx - w :] = tree_mask[m0 : m0 + q_len * w].view(q_len, w).bool()
    else:
        visible[:, prefix:] = torch.ones(q_len, q_len, dtype=torch.bool, device=device).tril()
    return visible


# ------------------------------------------------------------------------------------------- attending


def _attend_windows(out, q, k_cache, v_cache, w: _Windows, scale: float) -> None:
    n, (_, num_q_heads, head_dim), num_kv_heads = w.blocks.shape[0], q.shape, k_cache.shape[2]
    keys = k_cache[w.blocks].view(n, -1, num_kv_heads, head_dim)[:, : w.max_len]  # [n, Lmax, Hkv, D]
    values = v_cache[w.blocks].view(n, -1, num_kv_heads, head_dim)[:, : w.max_len]  # [n, Lmax, Hkv, D]
    q_rows = q if w.rows is None else q[w.rows]  # [t, Hq, D]
    if w.max_q == 1:
        padded = q_rows.float()[:, None]  # [n, 1, Hq, D]: one row per sequence, nothing to scatter
    else:
        padded = q.new_zeros(n, w.max_q, num_q_heads, head_dim, dtype=torch.float32)  # [n, Qmax, Hq, D]
        padded[w.seq_of_row, w.pos_in_seq] = q_rows.float()
    attended = scaled_dot_product_attention(
        padded.transpose(1, 2), keys.float().transpose(1, 2), values.float().transpose(1, 2),
        attn_mask=w.visible, scale=scale, enable_gqa=True,
    )  # [n, Hq, Qmax, D]
    result = attended.transpose(1, 2)[w.seq_of_row, w.pos_in_seq].to(q.dtype)  # [t, Hq, D]
    if w.rows is None:
        out.copy_(result)
    else:
        out[w.rows] = result


def _attend_one(out, q, k_cache, v_cache, seq: _LongSequence, scale: float) -> None:
    num_kv_heads, head_dim = k_cache.shape[2], k_cache.shape[3]
    keys = k_cache.view(-1, num_kv_heads, head_dim)[seq.slots]  # [ctx, Hkv, D]
    values = v_cache.view(-1, num_kv_heads, head_dim)[seq.slots]  # [ctx, Hkv, D]
    attended = scaled_dot_product_attention(
        q[seq.rows].float().transpose(0, 1)[None], keys.float().transpose(0, 1)[None],
        values.float().transpose(0, 1)[None], attn_mask=seq.visible, scale=scale, enable_gqa=True,
    )  # [1, Hq, q_len, D]
    out[seq.rows] = attended[0].transpose(0, 1).to(q.dtype)


# ------------------------------------------------------------------------------- uniform (static-shape) batches


def paged_attention_uniform_reference(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    q_len: int,
    scale: float,
) -> torch.Tensor:
    """Paged attention for a *uniform* causal batch, with no host read and no data-dependent shape.

    Every one of the B sequences has the same number of new tokens ``q_len`` (a decode: 1; a draft step: 1; a
    chain verification window: k + 1), so the padded layout is fixed by the shapes alone: this is the attention
    of the static forward that ``torch.compile(fullgraph=True)`` traces and a CUDA graph captures
    (``specdec/runner/cuda_graphs.py``). It computes what :func:`paged_attention_reference` computes for such a
    batch (causal, no tree mask), always gathering the block table's whole width: the cost follows
    ``max_blocks``, not the sequences' lengths.

    Args:
        q: ``[B * q_len, Hq, D]``; rows ``b * q_len : (b + 1) * q_len`` are sequence b's last ``q_len`` positions.
        k_cache, v_cache: ``[num_blocks, block_size, Hkv, D]``; the new tokens' K/V are already written.
        block_tables: int32 ``[B, max_blocks]``; entries past a sequence's last block may hold anything (they
            are read as block 0 and masked).
        seq_lens: int32 ``[B]``, ``q_len <= seq_len <= max_blocks * block_size`` (not checked: checking would
            read the values).
        q_len: new tokens per sequence, a Python int (part of the static shape).
        scale: softmax scale.
    Returns:
        ``[B * q_len, Hq, D]`` in q's dtype (computed in fp32).
    """
    num_seqs, max_blocks = block_tables.shape
    _, block_size, num_kv_heads, head_dim = k_cache.shape
    num_q_heads = q.shape[1]
    max_len = max_blocks * block_size
    lens = seq_lens.long()  # [B]
    # Entries past a sequence's end may hold anything (even ids outside the pool): read block 0 there, masked.
    used = torch.arange(max_blocks, device=q.device)[None, :] * block_size < lens[:, None]  # [B, nb]
    blocks = torch.where(used, block_tables.long(), 0)  # [B, nb]
    keys = k_cache[blocks].view(num_seqs, max_len, num_kv_heads, head_dim)  # [B, Lmax, Hkv, D]
    values = v_cache[blocks].view(num_seqs, max_len, num_kv_heads, head_dim)  # [B, Lmax, Hkv, D]
    # Query i of sequence b sits at position seq_len - q_len + i and sees the keys up to it (so < seq_len).
    query_pos = lens[:, None] - q_len + torch.arange(q_len, device=q.device)[None, :]  # [B, q_len]
    visible = torch.arange(max_len, device=q.device)[None, None, :] <= query_pos[:, :, None]  # [B, q_len, Lmax]
    attended = scaled_dot_product_attention(
        q.view(num_seqs, q_len, num_q_heads, head_dim).float().transpose(1, 2),
        keys.float().transpose(1, 2), values.float().transpose(1, 2),
        attn_mask=visible[:, None], scale=scale, enable_gqa=True,
    )  # [B, Hq, q_len, D]
    return attended.transpose(1, 2).reshape(num_seqs * q_len, num_q_heads, head_dim).to(q.dtype)
