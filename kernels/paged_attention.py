"""Paged attention over a block-table KV cache: decode, multi-token verification (causal) and tree masks.

Signature (the attention contract, docs/architecture.md):
    paged_attention(q, k_cache, v_cache, block_tables, seq_lens, cu_q_lens, scale,
                    tree_mask=None, tree_mask_indptr=None) -> out
"""

import torch


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
        tree_mask: optional bool/uint8 ``[sum(q_len_b ** 2)]``, row-major ``[q_len, q_len]`` per sequence:
            new token i sees new token j iff ``mask[i, j]``. Without it the new tokens are causal.
        tree_mask_indptr: int32 ``[B+1]`` offsets of each sequence's mask in ``tree_mask``.
    Returns:
        ``[T, Hq, D]`` in q's dtype (computed in fp32).
    """
    num_tokens, num_q_heads, head_dim = q.shape
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = num_q_heads // num_kv_heads
    out = torch.empty_like(q)
    seq_lens_l = seq_lens.tolist()
    cu_l = cu_q_lens.tolist()
    for b, ctx_len in enumerate(seq_lens_l):
        q_start, q_end = cu_l[b], cu_l[b + 1]
        q_len = q_end - q_start
        if q_len == 0:
            continue
        num_blocks = (ctx_len + block_size - 1) // block_size
        blocks = block_tables[b, :num_blocks].long()
        keys = k_cache[blocks].reshape(-1, num_kv_heads, head_dim)[:ctx_len].float()  # (ctx, Hkv, D)
        values = v_cache[blocks].reshape(-1, num_kv_heads, head_dim)[:ctx_len].float()  # (ctx, Hkv, D)
        keys = keys.repeat_interleave(group, dim=1)  # (ctx, Hq, D)
        values = values.repeat_interleave(group, dim=1)  # (ctx, Hq, D)
        qb = q[q_start:q_end].float()  # (q_len, Hq, D)
        scores = torch.einsum("qhd,khd->hqk", qb, keys) * scale  # (Hq, q_len, ctx)
        prefix = ctx_len - q_len
        visible = torch.ones(q_len, ctx_len, dtype=torch.bool, device=q.device)  # (q_len, ctx)
        if tree_mask is not None:
            m0 = int(tree_mask_indptr[b])
            new_mask = tree_mask[m0 : m0 + q_len * q_len].view(q_len, q_len).bool()
        else:
            new_mask = torch.ones(q_len, q_len, dtype=torch.bool, device=q.device).tril()
        visible[:, prefix:] = new_mask
        scores = scores.masked_fill(~visible, float("-inf"))
        probs = torch.softmax(scores, dim=-1)  # (Hq, q_len, ctx)
        out[q_start:q_end] = torch.einsum("hqk,khd->qhd", probs, values).to(q.dtype)
    return out
