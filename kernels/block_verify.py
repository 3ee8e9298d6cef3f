"""Block verification of draft chains (Sun et al., "Block Verification Accelerates Speculative Decoding", ICLR 2025).

Token-wise verification (``spec_sample``) accepts draft j with probability min(1, p_j(x_j) / q_j(x_j)) on its own
and stops at the first rejection. Block verification decides on the block jointly: it carries a weight across
positions, so a draft that the target likes more than the draft did can pay for a later one it likes less. Same
inputs, same cost (one pass over the verification rows), never fewer accepted tokens in expectation, lossless.

Same flattened layout, outputs and Philox streams as :mod:`specdec.kernels.spec_sample` (read its docstring):
``draft_token_ids [N]``, ``cu_num_draft_tokens [B + 1]``, ``draft_probs [N, V]``, ``target_probs [N + B, V]``
(request b's rows start at ``cu[b] + b``; the last one is the bonus row), ``target_argmax [N + B]``, ``is_greedy``,
``draft_is_onehot``, ``seeds``, ``positions`` -> ``output_token_ids int64 [B, max_k + 1]`` (accepted drafts, one
more token, then -1) and ``num_accepted int32 [B]``.

Algorithm (the paper's Algorithm 2) for a sampled request with k drafts x_1..x_k, P_i = p at draft position i
(row cu[b] + b + i), Q_i = q at draft position i (row cu[b] + i), Q_k = 0 (the bonus row has no draft):

    w_0 = 1,  w_i = min(1, w_{i-1} * P_{i-1}(x_i) / Q_{i-1}(x_i))                     i = 1..k
    r_i = sum_v max(w_i * P_i(v) - Q_i(v), 0)  (i < k),   r_k = w_k                  residual mass
    stop at i  iff  eta_i * (r_i + 1 - w_i) < r_i,  i.e. with probability h_i = r_i / (r_i + 1 - w_i)
    tau = the largest i in 1..k that stops, else 0
    emit x_1..x_tau, then one token from norm(max(w_tau * P_tau - Q_tau, 0))  (tau = k: from P_k, the bonus)

``eta_i = philox(seed, positions[b], STREAM_BLOCK_ACCEPT, i - 1)``: keyed by the round's first draft position, NOT
by draft i's own position (``positions[b] + i - 1``), unlike spec_sample's accept uniforms. Block verification
looks at every draft of the block, also those beyond tau, and the next round starts at ``positions[b] + tau + 1``:
position-keyed uniforms would be reused there after having conditioned this round's decision (a bias that
tests/kernels/test_block_verify_statistics.py detects). The round's start position grows every round (each
emits at least one token), so these are fresh. The same holds for the drafts themselves: see "Drafts" below.
The last token is ``argmax(max(w P - Q, 0) / E)`` with E on STREAM_RESIDUAL at position ``positions[b] + tau``,
exactly as ``spec_sample`` draws its correction / bonus token (``_argmax_over_noise`` with a scale ``w`` on p), so
no normalisation and no host sync. An all-zero residual (only possible at tau = 0 with P_0 <= Q_0 up to rounding;
the stop rule needs r_tau > 0 elsewhere) samples from P_tau. The decision ``eta * (r + 1 - w) < r`` never divides
(0/0 when w = 1 and P_i = Q_i reads as "never stop here", the correct limit), and once w = 0 no later position
can stop, so the kernel stops scanning.

Rows that fall back to the token-wise rule of ``spec_sample``, bit for bit (same streams, same decisions):
  * greedy rows (temperature 0): accept while the target's argmax equals the draft;
  * one-hot rows (``draft_is_onehot``: n-gram / prompt lookup, whose q is a point mass). There block verification
    has nothing to gain: with Q_i = onehot(x_{i+1}), r_i = w_i (1 - P_i(x_{i+1})) and w_i = prod_{j<=i} P(x_j),
    which gives exactly token-wise's distribution of tau and the same residual (P_i with x_{i+1} zeroed) -
    checked by enumeration in tests/kernels/test_block_verify_statistics.py. (vLLM's block-verification PR,
    vllm-project/vllm#40819, falls back the same way for drafters without probabilities.)

Drafts: the proof assumes x_i ~ Q_i given the text, independent of how earlier rounds were decided. Token-wise
verification never looks past the first rejection, so the next round, which starts right after it, only draws at
positions nobody has looked at. Block verification looks at the whole block, so a drafter whose noise is keyed by
absolute position (``DraftModelDrafter`` under "token": STREAM_DRAFT at (seed, position)) re-draws positions
``positions[b] + tau + 1 .. positions[b] + k - 1`` in the next round with noise this round's decision depended on
(with the same context - the correction token equal to the draft it replaced - it is the very same token). Exact
losslessness across rounds therefore needs draft noise fresh per round: under ``verify="block"`` the engine's draft
model keys draft j by (seed, round start, ``round_stream(STREAM_DRAFT, j)``) (``DraftModelDrafter.noise_per_round``),
as the statistical test draws its drafts (and shows the position-keyed variant biased).

NOTE (exactness): kernel and reference share every elementwise fp32 operation and every Philox uniform; the
residual masses r_i are sums over the vocabulary whose order differs (per-lane partial sums + a tree reduction
in the kernel, torch's order in the reference), so a stop decision can flip only when ``eta * (r + 1 - w)`` lies
within an ulp or so of ``r`` (probability ~1e-7 per decision), on top of spec_sample's ``-log`` ulp note. On a
GPU the compiler may also contract ``w * p - q`` into an FMA.

Over 300 lines because the Triton kernel, its launcher and its torch reference (the CPU path and the test oracle)
stay side by side, as every kernel's do.
"""

from __future__ import annotations

import torch

from specdec.kernels._triton import tl, triton
from specdec.kernels.philox import (
    STREAM_BLOCK_ACCEPT,
    STREAM_RESIDUAL,
    philox_uniform,
    philox_uniform_tl,
    row_exponentials,
)
from specdec.kernels.spec_sample import (
    _accept_tokenwise,
    _chain_final_token,
    _check_inputs,
    _finish_row,
    _request_prologue,
    launch_chain_kernel,
    spec_sample_reference,
)

_STREAM_BLOCK_ACCEPT: tl.constexpr = tl.constexpr(STREAM_BLOCK_ACCEPT)


@triton.jit
def _residual_mass(
    p_row_ptr,  # fp32 [V] target row P_i
    q_row_ptr,  # fp32 [V] draft row Q_i
    weight,  # scalar fp32 w_i
    vocab_size,
    BLOCK_V: tl.constexpr,
):
    """sum_v max(w p_v - q_v, 0) (fp32 scalar): per-lane partial sums over the vocabulary loop, one reduction."""
    lanes = tl.arange(0, BLOCK_V)
    acc = tl.zeros([BLOCK_V], tl.float32)
    for start in range(0, vocab_size, BLOCK_V):
        offs = start + lanes  # (BLOCK_V,)
        in_vocab = offs < vocab_size
        p = tl.load(p_row_ptr + offs, mask=in_vocab, other=0.0)
        q = tl.load(q_row_ptr + offs, mask=in_vocab, other=0.0)
        acc += tl.maximum(weight * p - q, 0.0)
    return tl.sum(acc, 0)


@triton.jit(do_not_specialize=["max_num_draft_tokens"])
def _block_verify_kernel(
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

    n = first_draft * 0  # int64 number of accepted drafts (tau)
    w_tau = tl.full([], 1.0, tl.float32)  # the weight at tau (1 at tau = 0 and on token-wise rows)
    if greedy | onehot:
        # spec_sample's token-wise rule (q(x) = 1 on these rows: its ``u * q(x)`` is ``u`` exactly).
        n = _accept_tokenwise(out_row_ptr, draft_ids_ptr, draft_probs_ptr, target_probs_ptr, target_argmax_ptr,
                              first_draft, first_target, num_drafts, greedy, onehot, seed, position,
                              vocab_size)  # fmt: skip
    else:
        # Block rule: forward over i = 1..k carrying w_i; tau = the last i whose stop test passes.
        w = tl.full([], 1.0, tl.float32)
        i = first_draft * 0
        scanning = num_drafts > 0
        while scanning:
            draft = tl.load(draft_ids_ptr + first_draft + i)
            in_vocab = (draft >= 0) & (draft < vocab_size)
            p_x = tl.load(target_probs_ptr + (first_target + i) * vocab_size + draft, mask=in_vocab, other=0.0)
            q_x = tl.load(draft_probs_ptr + (first_draft + i) * vocab_size + draft, mask=in_vocab, other=1.0)
            t = w * p_x
            w = tl.where(t <= 0.0, 0.0, tl.where(t >= q_x, 1.0, tl.math.div_rn(t, q_x)))  # min(1, w p / q)
            i += 1
            if i < num_drafts:
                r = _residual_mass(target_probs_ptr + (first_target + i) * vocab_size,
                                   draft_probs_ptr + (first_draft + i) * vocab_size, w, vocab_size, BLOCK_V)
            else:
                r = w  # the bonus row: Q_k = 0, sum_v w P_k(v) = w
            eta = philox_uniform_tl(seed, position, _STREAM_BLOCK_ACCEPT, i - 1)  # in (0, 1), keyed by the round
            stop = eta * (r + (1.0 - w)) < r
            n = tl.where(stop, i, n)
            w_tau = tl.where(stop, w, w_tau)
            scanning = (i < num_drafts) & (w > 0.0)  # w = 0: no later position can stop

    # One more token at position n: from max(w_tau P_n - Q_n, 0) (token-wise: w = 1), or the bonus from P_k;
    # an all-zero residual (tau = 0, P_0 <= Q_0 up to rounding) samples from P itself.
    scale = tl.where(n < num_drafts, w_tau, 1.0)
    token = _chain_final_token(draft_ids_ptr, draft_probs_ptr, target_probs_ptr, target_argmax_ptr, first_draft,
                               first_target, n, num_drafts, greedy, onehot, scale, seed, position, vocab_size,
                               BLOCK_V)  # fmt: skip
    cols = tl.arange(0, BLOCK_K)
    accepted = tl.load(draft_ids_ptr + first_draft + cols, mask=cols < n, other=-1)  # (BLOCK_K,)
    tl.store(out_row_ptr + cols, accepted, mask=cols < n)
    _finish_row(out_row_ptr, num_accepted_ptr, req, n, token, max_num_draft_tokens, BLOCK_K)


def block_verify(
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
    """Block verification of a batch of ragged draft chains (Triton, one program per request).

    Arguments and outputs are those of :func:`specdec.kernels.spec_sample.spec_sample` (layout in both module
    docstrings): int64 ``draft_token_ids [N]``, int32 ``cu_num_draft_tokens [B + 1]``, fp32 ``draft_probs [N, V]``
    or None (every row one-hot), fp32 ``target_probs [N + B, V]``, int64 ``target_argmax [N + B]``, bool
    ``is_greedy / draft_is_onehot [B]``, int64 ``seeds / positions [B]``, ``max_num_draft_tokens`` (max k_b, so
    the launcher never syncs); ``block_v`` overrides the vocabulary chunk (tests).
    Returns ``(output_token_ids int64 [B, max_k + 1] padded with -1, num_accepted int32 [B])``.
    """
    return launch_chain_kernel(
        _block_verify_kernel, draft_token_ids, cu_num_draft_tokens, draft_probs, target_probs, target_argmax,
        is_greedy, draft_is_onehot, seeds, positions, max_num_draft_tokens, block_v=block_v,
    )  # fmt: skip


def block_weights(p_x: torch.Tensor, q_x: torch.Tensor) -> torch.Tensor:
    """The carried weights ``w [..., K]``: w_i = min(1, w_{i-1} p_x[i-1] / q_x[i-1]), w_0 = 1 (0 once w p = 0).

    ``p_x, q_x [..., K]``: P_{i-1}(x_i) and Q_{i-1}(x_i) of each draft, any float dtype (the tests enumerate in
    float64). A named step so tests can plant the per-token mutant in it.
    """
    w = p_x.new_ones(p_x.shape[:-1])  # (...,) w_0
    weights = []
    for i in range(p_x.shape[-1]):
        t = w * p_x[..., i]
        w = torch.where(t <= 0, 0.0, torch.where(t >= q_x[..., i], 1.0, t / q_x[..., i]))
        weights.append(w)
    return torch.stack(weights, dim=-1) if weights else torch.empty_like(p_x)


def block_uniforms(seeds: torch.Tensor, positions: torch.Tensor, k: int) -> torch.Tensor:
    """eta ``fp32 [S, k]`` of rounds starting at ``positions [S]``: keyed by the round, index = draft offset."""
    j = torch.arange(k, device=seeds.device)  # (k,)
    return philox_uniform(seeds[:, None], positions[:, None], STREAM_BLOCK_ACCEPT, j)


def residual_mass(w: torch.Tensor, p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """``sum_v max(w p_v - q_v, 0)``: ``w [...]``, ``p, q [..., V]`` -> ``[...]``."""
    return torch.clamp(w[..., None] * p - q, min=0.0).sum(dim=-1)


def block_verify_reference(
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
    """Torch reference (the CPU path and the test oracle) of :func:`block_verify`; same arguments and outputs.

    Raises ``ValueError`` on bad shapes/dtypes and on bad metadata values (it reads them; it is not the GPU path).
    """
    _check_inputs(draft_token_ids, cu_num_draft_tokens, draft_probs, target_probs, target_argmax, is_greedy,
                  draft_is_onehot, seeds, positions, max_num_draft_tokens, read_values=True)  # fmt: skip
    block_rows = ~is_greedy & ~draft_is_onehot if draft_probs is not None else torch.zeros_like(is_greedy)  # (B,)
    # Token-wise rows: spec_sample's reference. The block rows ride along marked greedy (no noise is drawn for
    # them there) and are overwritten below.
    out, num_accepted = spec_sample_reference(
        draft_token_ids, cu_num_draft_tokens, draft_probs, target_probs, target_argmax, is_greedy | block_rows,
        draft_is_onehot, seeds, positions, max_num_draft_tokens,
    )  # fmt: skip
    idx = block_rows.nonzero().squeeze(1)  # (S,) a sync on CUDA, fine for a reference
    if idx.numel() == 0:
        return out, num_accepted
    tokens, tau = _block_rows(idx, draft_token_ids, cu_num_draft_tokens, draft_probs, target_probs, seeds,
                              positions, max_num_draft_tokens)
    out[idx] = tokens
    num_accepted[idx] = tau.to(torch.int32)
    return out, num_accepted


def _block_rows(idx, draft_token_ids, cu_num_draft_tokens, draft_probs, target_probs, seeds, positions, max_k):
    """Block verification of requests ``idx [S]``: ``(tokens int64 [S, max_k + 1], tau int64 [S])``."""
    device, vocab = target_probs.device, target_probs.shape[1]
    num_total = draft_token_ids.shape[0]
    cu = cu_num_draft_tokens.long()
    first_draft = cu[:-1][idx]  # (S,)
    first_target = first_draft + idx  # (S,)
    ks = (cu[1:] - cu[:-1])[idx]  # (S,)
    seed, position = seeds[idx], positions[idx]
    j = torch.arange(max_k, device=device)  # (K,) draft j + 1 sits at position + j
    has_draft = j[None, :] < ks[:, None]  # (S, K)
    draft_idx = torch.where(has_draft, first_draft[:, None] + j, 0).clamp(max=max(num_total - 1, 0))  # (S, K)
    drafts = draft_token_ids[draft_idx] if num_total else draft_idx  # (S, K); garbage where padded
    p_x = target_probs[torch.where(has_draft, first_target[:, None] + j, 0), drafts]  # (S, K)
    q_x = draft_probs[draft_idx, drafts] if num_total else torch.ones_like(p_x)  # (S, K)
    w = block_weights(p_x, q_x)  # (S, K): w[:, j] = w_{j+1}

    # Residual mass after draft j + 1 (the next draft position's rows), w itself at the bonus row.
    r = torch.zeros_like(w)  # (S, K)
    for col in range(max_k):
        has_next = col + 1 < ks  # (S,)
        if not bool(has_next.any()):
            r[:, col] = w[:, col]
            continue
        p_next = target_probs[torch.where(has_next, first_target + col + 1, 0)]  # (S, V)
        q_next = draft_probs[torch.where(has_next, first_draft + col + 1, 0).clamp(max=num_total - 1)]  # (S, V)
        r[:, col] = torch.where(has_next, residual_mass(w[:, col], p_next, q_next), w[:, col])
    eta = block_uniforms(seed, position, max_k)  # (S, K)
    stop = (eta * (r + (1.0 - w)) < r) & has_draft  # (S, K)
    tau = torch.where(stop, j + 1, 0).amax(dim=1) if max_k else ks * 0  # (S,) the last position that stops

    # The last token from max(w_tau P_tau - Q_tau, 0); Q_k = 0 and w = 1 at the bonus row.
    rejected = tau < ks  # (S,)
    w_tau = w.gather(1, (tau - 1).clamp(min=0)[:, None]).squeeze(1) if max_k else tau * 0.0  # (S,)
    scale = torch.where(rejected & (tau > 0), w_tau, 1.0)  # (S,)
    p = target_probs[first_target + tau]  # (S, V)
    q = torch.zeros_like(p)
    if num_total:
        q = torch.where(rejected[:, None], draft_probs[(first_draft + tau).clamp(max=num_total - 1)], q)
    residual = torch.clamp(scale[:, None] * p - q, min=0.0)  # (S, V)
    dist = torch.where((residual > 0).any(dim=-1, keepdim=True), residual, p)  # all-zero residual: sample from p
    noise = row_exponentials(seed, position + tau, STREAM_RESIDUAL, vocab)  # (S, V)
    token = (dist / noise).argmax(dim=-1)  # (S,)

    tokens = torch.where(j[None, :] < tau[:, None], drafts, -1)  # (S, K) accepted prefix
    tokens = torch.cat([tokens, tokens.new_full((idx.shape[0], 1), -1)], dim=1)  # (S, K + 1)
    tokens.scatter_(1, tau[:, None], token[:, None])
    return tokens, tau
