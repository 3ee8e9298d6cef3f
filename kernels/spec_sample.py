"""Fused speculative verification: accept/reject of the drafts, the correction token (drawn from the residual
distribution) and the bonus token.

Leviathan et al. 2023, section 2.3 (Algorithm 1), for a batch of requests with ragged draft lengths, one
Triton program per request. Layout (flattened like vLLM's rejection sampler; N = total drafts, B = requests):

    draft_token_ids      int64 [N]        drafts of request b are draft_token_ids[cu[b]:cu[b+1]] (k_b = cu[b+1] - cu[b])
    cu_num_draft_tokens  int32 [B + 1]    cu[0] = 0, nondecreasing, cu[B] = N; k_b = 0 is allowed
    draft_probs          fp32  [N, V]     standardized q of each draft (same rows as draft_token_ids), or None
    target_probs         fp32  [N + B, V] standardized p; request b owns k_b + 1 rows starting at cu[b] + b:
                                          row cu[b] + b + j is p at draft position j (j = k_b: the bonus row)
    target_argmax        int64 [N + B]    argmax of the raw (penalised) target logits, same rows (greedy rows)
    is_greedy            bool  [B]        temperature-0 request
    draft_is_onehot      bool  [B]        deterministic drafter (n-gram, argmax): q is one-hot at the draft
    seeds, positions     int64 [B]        request seed; absolute position of the first draft token
    -> output_token_ids  int64 [B, max_k + 1]  accepted drafts, then one correction/bonus token, then -1
    -> num_accepted      int32 [B]        accepted drafts; row b emits num_accepted[b] + 1 tokens

Per request, draft j sits at position positions[b] + j and the bonus at positions[b] + k_b.
Sampled rows accept draft x_j iff ``u_j * q(x_j) < p(x_j)`` (P = min(1, p/q) without a division; q = 0 never
divides), u_j = philox(seed, position, STREAM_ACCEPT, 0). At the first rejection the token is drawn from
norm(max(p - q, 0)) as ``argmax(max(p - q, 0) / E)``, E_v = -log(philox(seed, position, STREAM_RESIDUAL, v)), so
no normalisation and no host sync; if that residual is all zero (p <= q up to rounding) it is drawn from p the
same way. All accepted: the bonus is ``argmax(p_k / E)`` on the same stream at the bonus position (q = 0 there,
so it is the same formula). One-hot drafts: q = onehot(x), i.e. accept with probability p(x) and the residual is
p with x zeroed; draft_probs is never read for those rows. Greedy rows accept while target_argmax == draft and
emit target_argmax at the first mismatch (or at the bonus row).

NOTE (exactness): kernel and reference use the same Philox uniforms bit for bit and the same fp32 products,
differences and (round-to-nearest) quotients; only ``-log(u)`` may differ by an ulp between ``torch.log`` and
``tl.log``. That can flip an argmax only when two candidates' scores tie to within an ulp, which is
astronomically unlikely for continuous noise, so the two agree token for token in practice.

Over 300 lines because the Triton kernel, its launcher and its torch reference (the CPU path and the test oracle)
stay side by side, as every kernel's do.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from specdec.kernels._triton import tl, triton
from specdec.kernels.philox import STREAM_ACCEPT, STREAM_RESIDUAL, philox_uniform, philox_uniform_tl, row_exponentials

_STREAM_ACCEPT: tl.constexpr = tl.constexpr(STREAM_ACCEPT)
_STREAM_RESIDUAL: tl.constexpr = tl.constexpr(STREAM_RESIDUAL)


@dataclass(frozen=True)
class SpecSampleConfig:
    """Launch settings of the kernel for one vocabulary size."""

    block_v: int  # vocabulary chunk of the residual/bonus argmax loop (power of two)
    num_warps: int


def spec_sample_config(vocab_size: int) -> SpecSampleConfig:
    """Fixed heuristic (no autotune): chunks of up to 2048 tokens; the kernel loops over longer vocabularies.

    NOTE: a chunk holds p, q, the Philox state (4 counters + 2 keys) and the score per element; 2048 over
    8 warps is 8 elements per thread, which keeps the Philox rounds in registers without spilling.
    """
    if vocab_size < 1:
        raise ValueError(f"vocab_size must be >= 1, got {vocab_size}")
    block_v = min(triton.next_power_of_2(vocab_size), 2048)
    return SpecSampleConfig(block_v=block_v, num_warps=4 if block_v <= 1024 else 8)


@triton.jit
def _argmax_over_noise(
    p_row_ptr,  # fp32 [V] target row
    q_row_ptr,  # fp32 [V] draft row (read only where load_q)
    load_q,  # scalar bool: subtract the draft row
    onehot_token,  # scalar int: subtract a one-hot q at this token (-1: none)
    p_scale,  # scalar fp32: weight w on the target row (1.0 here; block verification's w_tau in block_verify.py)
    seed,
    position,
    vocab_size,
    BLOCK_V: tl.constexpr,
):
    """(argmax_v max(w p_v - q_v, 0) / E_v, max_v max(w p_v - q_v, 0)), E_v = -log(philox(seed, position, v)),
    w = ``p_scale`` (1.0 * p is exact, so w = 1 is the plain residual bit for bit).

    Per-lane running state (vectors of BLOCK_V: best score, its index, max residual), reduced across lanes once
    after the loop. Ties resolve to the lowest index, like torch.argmax: within a lane a later chunk must be
    strictly better, and across lanes the smallest index among the lanes holding the maximum wins.
    """
    lanes = tl.arange(0, BLOCK_V)
    best_score = tl.full([BLOCK_V], -1.0, tl.float32)  # below every real score (>= 0)
    best_index = lanes  # int32; a lane that never sees a token keeps score -1 and is never chosen
    max_residual = tl.zeros([BLOCK_V], tl.float32)
    for start in range(0, vocab_size, BLOCK_V):
        offs = start + lanes  # (BLOCK_V,)
        in_vocab = offs < vocab_size
        p = tl.load(p_row_ptr + offs, mask=in_vocab, other=0.0)
        q = tl.load(q_row_ptr + offs, mask=tl.where(load_q, in_vocab, False), other=0.0)
        q = tl.where(offs == onehot_token, 1.0, q)
        residual = tl.maximum(p_scale * p - q, 0.0)
        best_score, best_index, max_residual = _noise_argmax_update(
            residual, in_vocab, offs, seed, position, best_score, best_index, max_residual
        )
    return _noise_argmax_reduce(best_score, best_index, max_residual)


@triton.jit
def _noise_argmax_update(residual, in_vocab, offs, seed, position, best_score, best_index, max_residual):
    """One chunk (all (BLOCK_V,)) of the running per-lane argmax of ``residual / E`` (E_v = -log(philox(seed,
    position, STREAM_RESIDUAL, v))) and max of ``residual``; returns the updated (best_score, best_index,
    max_residual). Shared with tree_sample's ``_residual_argmax``."""
    noise = -tl.log(philox_uniform_tl(seed, position, _STREAM_RESIDUAL, offs))  # Exp(1), finite, > 0
    score = tl.where(in_vocab, tl.math.div_rn(residual, noise), -1.0)
    better = score > best_score  # strict: the lane's earlier (lower) index wins ties
    best_index = tl.where(better, offs, best_index)
    best_score = tl.where(better, score, best_score)
    max_residual = tl.maximum(max_residual, residual)
    return best_score, best_index, max_residual


@triton.jit
def _noise_argmax_reduce(best_score, best_index, max_residual):
    """(argmax, max residual) across lanes: the lowest index among the lanes holding the best score."""
    top = tl.max(best_score, 0)
    index = tl.min(tl.where(best_score == top, best_index, 0x7FFFFFFF), 0)  # lowest index among the tied lanes
    return index, tl.max(max_residual, 0)


@triton.jit
def _request_prologue(cu_ptr, is_greedy_ptr, onehot_ptr, seeds_ptr, positions_ptr, HAS_DRAFT_PROBS: tl.constexpr):
    """This program's request and its per-request scalars (shared by the spec_sample, block_verify and tree_sample
    kernels): ``(req, first row cu[req], row count cu[req + 1] - cu[req], greedy, onehot, seed, position)``;
    req / first / count int64, greedy / onehot bool (onehot is True everywhere without HAS_DRAFT_PROBS)."""
    # Unmasked scalar loads: rows that exist by the layout (cu is checked on the host off the GPU).
    req = tl.program_id(0).to(tl.int64)
    first = tl.load(cu_ptr + req).to(tl.int64)
    count = tl.load(cu_ptr + req + 1).to(tl.int64) - first
    greedy = tl.load(is_greedy_ptr + req) != 0
    if HAS_DRAFT_PROBS:
        onehot = tl.load(onehot_ptr + req) != 0
    else:
        onehot = greedy | True
    seed = tl.load(seeds_ptr + req)
    position = tl.load(positions_ptr + req)
    return req, first, count, greedy, onehot, seed, position


@triton.jit
def _accept_tokenwise(
    out_row_ptr, draft_ids_ptr, draft_probs_ptr, target_probs_ptr, target_argmax_ptr, first_draft, first_target,
    num_drafts, greedy, onehot, seed, position, vocab_size,
):  # fmt: skip
    """Accept drafts in order until the first rejection, storing each accepted draft at ``out_row_ptr + n``;
    returns n (int64). Sampled rows: ``u * q(x) < p(x)`` (q(x) = 1 for one-hot rows); greedy rows: argmax == x.
    A while loop with a flag: no ``break`` on GPUs."""
    n = first_draft * 0  # int64 number accepted so far
    accepting = num_drafts > 0
    while accepting:
        draft = tl.load(draft_ids_ptr + first_draft + n)
        target_row = first_target + n
        read_probs = (draft >= 0) & (draft < vocab_size) & (not greedy)
        p_x = tl.load(target_probs_ptr + target_row * vocab_size + draft, mask=read_probs, other=0.0)
        q_x = tl.load(
            draft_probs_ptr + (first_draft + n) * vocab_size + draft, mask=read_probs & (not onehot), other=1.0
        )
        u = philox_uniform_tl(seed, position + n, _STREAM_ACCEPT, n * 0)  # in (0, 1)
        sampled_ok = u * q_x < p_x  # u < p/q without dividing
        greedy_ok = tl.load(target_argmax_ptr + target_row) == draft
        ok = tl.where(greedy, greedy_ok, sampled_ok)
        tl.store(out_row_ptr + n, draft, mask=ok)
        n += ok.to(tl.int64)
        accepting = ok & (n < num_drafts)
    return n


@triton.jit
def _chain_final_token(
    draft_ids_ptr, draft_probs_ptr, target_probs_ptr, target_argmax_ptr, first_draft, first_target, n, num_drafts,
    greedy, onehot, p_scale, seed, position, vocab_size, BLOCK_V: tl.constexpr,
):  # fmt: skip
    """The token after n accepted drafts (int64): the target's argmax on greedy rows, else
    ``argmax(max(w p_n - q_n, 0) / E)`` at position + n (w = ``p_scale``; q_n = 0 at the bonus row), or from p_n
    itself when that residual is all zero (p <= q up to rounding)."""
    final_row = first_target + n
    token = tl.load(target_argmax_ptr + final_row)
    if not greedy:
        rejected = n < num_drafts
        rejected_draft = tl.load(draft_ids_ptr + first_draft + n, mask=rejected & onehot, other=-1)
        p_row_ptr = target_probs_ptr + final_row * vocab_size
        q_row_ptr = draft_probs_ptr + (first_draft + n) * vocab_size
        sampled, max_residual = _argmax_over_noise(
            p_row_ptr, q_row_ptr, rejected & (not onehot), rejected_draft, p_scale, seed, position + n, vocab_size,
            BLOCK_V,
        )
        if max_residual <= 0.0:  # residual all zero: sample from p itself
            no_q = rejected & False
            no_onehot = rejected_draft * 0 - 1
            sampled, max_residual = _argmax_over_noise(
                p_row_ptr, q_row_ptr, no_q, no_onehot, 1.0, seed, position + n, vocab_size, BLOCK_V
            )
        token = sampled.to(tl.int64)
    return token


@triton.jit
def _finish_row(out_row_ptr, num_accepted_ptr, req, n, token, max_len, BLOCK: tl.constexpr):
    """``out_row[n] = token``, ``num_accepted[req] = n`` (int32) and ``out_row[n + 1 .. max_len] = -1``."""
    tl.store(out_row_ptr + n, token)
    tl.store(num_accepted_ptr + req, n.to(tl.int32))
    cols = tl.arange(0, BLOCK)
    tl.store(out_row_ptr + cols, tl.full([BLOCK], -1, tl.int64), mask=(cols > n) & (cols <= max_len))


@triton.jit(do_not_specialize=["max_num_draft_tokens"])
def _spec_sample_kernel(
    out_ptr,  # int64 [B, max_k + 1]
    num_accepted_ptr,  # int32 [B]
    draft_ids_ptr,  # int64 [N]
    cu_ptr,  # int32 [B + 1]
    draft_probs_ptr,  # fp32 [N, V] (any fp32 tensor when not HAS_DRAFT_PROBS; never read then)
    target_probs_ptr,  # fp32 [N + B, V]
    target_argmax_ptr,  # int64 [N + B]
    is_greedy_ptr,  # bool [B]
    onehot_ptr,  # bool [B]
    seeds_ptr,  # int64 [B]
    positions_ptr,  # int64 [B]
    max_num_draft_tokens,
    vocab_size,
    HAS_DRAFT_PROBS: tl.constexpr,
    BLOCK_V: tl.constexpr,
    BLOCK_K: tl.constexpr,  # >= max_num_draft_tokens + 1 (padding store)
):
    req, first_draft, num_drafts, greedy, onehot, seed, position = _request_prologue(
        cu_ptr, is_greedy_ptr, onehot_ptr, seeds_ptr, positions_ptr, HAS_DRAFT_PROBS
    )
    # NOTE: clamped so a caller's wrong max_num_draft_tokens can never write outside the output row.
    num_drafts = tl.minimum(num_drafts, max_num_draft_tokens)
    first_target = first_draft + req  # request b's target rows start at cu[b] + b
    out_row_ptr = out_ptr + req * (max_num_draft_tokens + 1)
    n = _accept_tokenwise(out_row_ptr, draft_ids_ptr, draft_probs_ptr, target_probs_ptr, target_argmax_ptr,
                          first_draft, first_target, num_drafts, greedy, onehot, seed, position,
                          vocab_size)  # fmt: skip
    # One more token at position n: the correction token after a rejection, or the bonus token.
    token = _chain_final_token(draft_ids_ptr, draft_probs_ptr, target_probs_ptr, target_argmax_ptr, first_draft,
                               first_target, n, num_drafts, greedy, onehot, 1.0, seed, position, vocab_size,
                               BLOCK_V)  # fmt: skip
    _finish_row(out_row_ptr, num_accepted_ptr, req, n, token, max_num_draft_tokens, BLOCK_K)


def spec_sample(
    draft_token_ids: torch.Tensor,
    cu_num_draft_tokens: torch.Tensor,
    draft_probs: torch.Tensor | None,
    target_probs: torch.Tensor,
    target_argmax: torch.Tensor,
    is_greedy: torch.Tensor,
    draft_is_onehot: torch.Tensor,
    seeds: torch.Tensor,
    positions: torch.Tensor,
    max_num_draft_tokens: int,
    *,
    block_v: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Fused verification of a batch of ragged draft chains (Triton); layout in the module docstring.

    Args:
        draft_token_ids: int64 ``[N]``.
        cu_num_draft_tokens: int32 ``[B + 1]``.
        draft_probs: fp32 ``[N, V]``, or None when every row is one-hot (then every row is treated as one-hot).
        target_probs: fp32 ``[N + B, V]`` standardized p.
        target_argmax: int64 ``[N + B]`` argmax of the raw target logits.
        is_greedy, draft_is_onehot: bool ``[B]``.
        seeds, positions: int64 ``[B]``.
        max_num_draft_tokens: max_b k_b (passed in so the launcher never syncs).
        block_v: override of the vocabulary chunk (tests use it to cover several chunks on a small vocab).
    Returns:
        output_token_ids: int64 ``[B, max_num_draft_tokens + 1]`` padded with -1.
        num_accepted: int32 ``[B]``.
    """
    return launch_chain_kernel(
        _spec_sample_kernel, draft_token_ids, cu_num_draft_tokens, draft_probs, target_probs, target_argmax,
        is_greedy, draft_is_onehot, seeds, positions, max_num_draft_tokens, block_v=block_v,
    )  # fmt: skip


def launch_chain_kernel(
    kernel, draft_token_ids, cu_num_draft_tokens, draft_probs, target_probs, target_argmax, is_greedy,
    draft_is_onehot, seeds, positions, max_num_draft_tokens, *, block_v,
) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """Check the inputs of :func:`spec_sample` and launch ``kernel`` (``_spec_sample_kernel`` or block_verify's
    kernel, which take the same arguments), one program per request; returns ``(output_token_ids, num_accepted)``."""
    # NOTE: reading values is free off the GPU (the interpreter would crash on a bad index); on CUDA it would be
    # a host sync, so there the caller's metadata is trusted (the kernel still clamps k_b).
    _check_inputs(draft_token_ids, cu_num_draft_tokens, draft_probs, target_probs, target_argmax, is_greedy,
                  draft_is_onehot, seeds, positions, max_num_draft_tokens, read_values=not target_probs.is_cuda)
    batch, vocab = seeds.shape[0], target_probs.shape[1]
    out = torch.empty((batch, max_num_draft_tokens + 1), dtype=torch.int64, device=target_probs.device)
    num_accepted = torch.empty(batch, dtype=torch.int32, device=target_probs.device)
    if batch == 0:
        return out, num_accepted
    config = with_block_v(spec_sample_config(vocab), block_v)
    kernel[(batch,)](
        out, num_accepted, draft_token_ids, cu_num_draft_tokens,
        target_probs if draft_probs is None else draft_probs, target_probs, target_argmax,
        is_greedy, draft_is_onehot, seeds, positions, max_num_draft_tokens, vocab,
        HAS_DRAFT_PROBS=draft_probs is not None, BLOCK_V=config.block_v,
        BLOCK_K=triton.next_power_of_2(max_num_draft_tokens + 1), num_warps=config.num_warps,
    )  # fmt: skip
    return out, num_accepted


def with_block_v(config, block_v: int | None):
    """``config`` (a frozen dataclass with a ``block_v`` field) with its vocabulary chunk overridden by ``block_v``
    (tests use it to cover several chunks on a small vocabulary); ``None`` keeps it."""
    if block_v is None:
        return config
    if block_v < 1 or block_v & (block_v - 1):
        raise ValueError(f"block_v must be a power of two, got {block_v}")
    return dataclasses.replace(config, block_v=block_v)


def residual_distribution(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """Unnormalised residual ``max(p - q, 0)`` (fp32 ``[R, V]``); a named step so tests can plant mutants in it."""
    return torch.clamp(p - q, min=0.0)


def spec_sample_reference(
    draft_token_ids: torch.Tensor,
    cu_num_draft_tokens: torch.Tensor,
    draft_probs: torch.Tensor | None,
    target_probs: torch.Tensor,
    target_argmax: torch.Tensor,
    is_greedy: torch.Tensor,
    draft_is_onehot: torch.Tensor,
    seeds: torch.Tensor,
    positions: torch.Tensor,
    max_num_draft_tokens: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Torch reference (the CPU path and the test oracle) of :func:`spec_sample`; same arguments and outputs.

    Raises ``ValueError`` on bad shapes/dtypes and on bad metadata values (it reads them; it is not the GPU path).
    """
    _check_inputs(draft_token_ids, cu_num_draft_tokens, draft_probs, target_probs, target_argmax, is_greedy,
                  draft_is_onehot, seeds, positions, max_num_draft_tokens, read_values=True)  # fmt: skip
    device = target_probs.device
    batch, vocab, max_k = seeds.shape[0], target_probs.shape[1], max_num_draft_tokens
    num_total = draft_token_ids.shape[0]
    onehot = torch.ones_like(draft_is_onehot) if draft_probs is None else draft_is_onehot
    rows = torch.arange(batch, device=device)  # (B,)
    cu = cu_num_draft_tokens.long()
    num_drafts = cu[1:] - cu[:-1]  # (B,)
    j = torch.arange(max_k, device=device)  # (K,)
    has_draft = j[None, :] < num_drafts[:, None]  # (B, K)
    draft_idx = torch.where(has_draft, cu[:-1, None] + j, num_total)  # (B, K); N = a padding slot
    target_row = torch.where(has_draft, (cu[:-1] + rows)[:, None] + j, 0)  # (B, K)

    # Accept / reject every draft; the accepted prefix ends at the first rejection.
    drafts = torch.cat([draft_token_ids, draft_token_ids.new_zeros(1)])[draft_idx]  # (B, K), 0 where padded
    p_x = target_probs[target_row, drafts]  # (B, K)
    model_q = draft_probs if draft_probs is not None and num_total > 0 else None  # None: q is one-hot or unused
    if model_q is None:
        q_x = torch.ones_like(p_x)
    else:
        q_x = torch.where(onehot[:, None], 1.0, model_q[draft_idx.clamp(max=num_total - 1), drafts])
    u = philox_uniform(seeds[:, None], positions[:, None] + j, STREAM_ACCEPT, torch.zeros_like(j))  # (B, K)
    ok = torch.where(is_greedy[:, None], target_argmax[target_row] == drafts, u * q_x < p_x) & has_draft
    n = ok.long().cumprod(dim=-1).sum(dim=-1)  # (B,) length of the accepted prefix

    # The correction token at the first rejection, or the bonus token, at position n - for the sampled rows only
    # (greedy rows keep the target's argmax), each [S, V] step a fresh tensor at most once.
    # NOTE: boolean indexing syncs on CUDA, which is fine for a reference.
    rejected = n < num_drafts  # (B,)
    final_row = cu[:-1] + rows + n  # (B,)
    rejected_draft = drafts.gather(1, n.clamp(max=max(max_k - 1, 0))[:, None]).squeeze(1) if max_k else rows * 0
    token = target_argmax[final_row]  # (B,)
    sampled = (~is_greedy).nonzero().squeeze(1)  # (S,)
    p = target_probs[final_row[sampled]]  # (S, V)
    q = torch.zeros_like(p)  # (S, V): no draft to subtract at the bonus position
    if model_q is not None:
        with_q = (rejected & ~onehot)[sampled].nonzero().squeeze(1)  # rows whose q is the draft model's
        q[with_q] = model_q[(cu[:-1] + n)[sampled][with_q].clamp(max=num_total - 1)]
    with_onehot = (rejected & onehot)[sampled].nonzero().squeeze(1)  # q = onehot(the rejected draft)
    q[with_onehot, rejected_draft[sampled][with_onehot]] = 1.0
    residual = residual_distribution(p, q)  # (S, V)
    all_zero = ~(residual > 0).any(dim=-1)  # (S,) p <= q up to rounding: sample from p
    residual[all_zero] = p[all_zero]
    noise = row_exponentials(seeds[sampled], positions[sampled] + n[sampled], STREAM_RESIDUAL, vocab)  # (S, V)
    token[sampled] = (residual / noise).argmax(dim=-1)

    out = torch.where(j[None, :] < n[:, None], drafts, -1)  # (B, K) accepted prefix
    out = torch.cat([out, out.new_full((batch, 1), -1)], dim=1)  # (B, K + 1)
    out.scatter_(1, n[:, None], token[:, None])
    return out, n.to(torch.int32)


def _check_inputs(
    draft_token_ids, cu_num_draft_tokens, draft_probs, target_probs, target_argmax, is_greedy, draft_is_onehot,
    seeds, positions, max_num_draft_tokens, *, read_values: bool,
) -> None:  # fmt: skip
    """Shapes, dtypes, devices and contiguity, then (``read_values``) the metadata values with
    :func:`_check_values`, which reads tensors: a host sync on CUDA, so the CUDA launcher skips it."""
    if not isinstance(max_num_draft_tokens, int) or max_num_draft_tokens < 0:
        raise ValueError(f"max_num_draft_tokens must be an int >= 0, got {max_num_draft_tokens!r}")
    if target_probs.ndim != 2:
        raise ValueError(f"target_probs must be [N + B, V], got shape {tuple(target_probs.shape)}")
    if cu_num_draft_tokens.ndim != 1 or cu_num_draft_tokens.shape[0] < 1:
        raise ValueError(f"cu_num_draft_tokens must be [B + 1], got shape {tuple(cu_num_draft_tokens.shape)}")
    num_total, batch, vocab = draft_token_ids.shape[0], cu_num_draft_tokens.shape[0] - 1, target_probs.shape[1]
    expected = {
        "draft_token_ids": (draft_token_ids, torch.int64, (num_total,)),
        "cu_num_draft_tokens": (cu_num_draft_tokens, torch.int32, (batch + 1,)),
        "target_probs": (target_probs, torch.float32, (num_total + batch, vocab)),
        "target_argmax": (target_argmax, torch.int64, (num_total + batch,)),
        "is_greedy": (is_greedy, torch.bool, (batch,)),
        "draft_is_onehot": (draft_is_onehot, torch.bool, (batch,)),
        "seeds": (seeds, torch.int64, (batch,)),
        "positions": (positions, torch.int64, (batch,)),
    }
    if draft_probs is not None:
        expected["draft_probs"] = (draft_probs, torch.float32, (num_total, vocab))
    check_tensors(expected, target_probs, f"N={num_total}, B={batch}")
    if read_values:
        _check_values(draft_token_ids, cu_num_draft_tokens, draft_probs, target_probs, draft_is_onehot,
                      max_num_draft_tokens)  # fmt: skip


def check_tensors(expected: dict, target_probs: torch.Tensor, sizes: str) -> None:
    """Every ``name -> (tensor, dtype, shape)`` of ``expected`` must have that dtype and shape, live on
    ``target_probs``'s device and be contiguous; ``sizes`` (e.g. ``"N=8, B=2"``) names the sizes in the error."""
    for name, (tensor, dtype, shape) in expected.items():
        if tensor.dtype != dtype:
            raise ValueError(f"{name} must be {dtype}, got {tensor.dtype}")
        if tuple(tensor.shape) != shape:
            raise ValueError(f"{name} must have shape {shape} ({sizes}), got {tuple(tensor.shape)}")
        if tensor.device != target_probs.device:
            raise ValueError(f"{name} is on {tensor.device} but target_probs is on {target_probs.device}")
        if not tensor.is_contiguous():
            raise ValueError(f"{name} must be contiguous (call .contiguous())")


def _check_values(
    draft_token_ids, cu_num_draft_tokens, draft_probs, target_probs, draft_is_onehot, max_num_draft_tokens
) -> None:
    """Metadata values (reads tensors)."""
    cu = cu_num_draft_tokens.long()
    num_drafts = cu[1:] - cu[:-1]
    if cu[0].item() != 0 or cu[-1].item() != draft_token_ids.shape[0] or bool((num_drafts < 0).any()):
        raise ValueError("cu_num_draft_tokens must start at 0, be nondecreasing and end at len(draft_token_ids)")
    if num_drafts.numel() and num_drafts.max().item() > max_num_draft_tokens:
        raise ValueError(
            f"a request has {num_drafts.max().item()} drafts > max_num_draft_tokens={max_num_draft_tokens}")
    if bool(((draft_token_ids < 0) | (draft_token_ids >= target_probs.shape[1])).any()):
        raise ValueError(f"draft_token_ids must lie in [0, {target_probs.shape[1]})")
    if draft_probs is None and not bool(draft_is_onehot.all()):
        raise ValueError("draft_probs=None needs every row to be one-hot (draft_is_onehot all True)")
