"""The fused verification kernel against its torch reference: equality, exact cases, invariants, determinism.

On CPU the kernel runs in the Triton interpreter (~1000x slower than torch), so vocabularies stay small and
``block_v`` is forced below the vocabulary to cover the chunked argmax loop. On CUDA the same tests run compiled.
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
from specdec.kernels.spec_sample import spec_sample, spec_sample_config, spec_sample_reference


def random_batch(num_drafts: list[int], vocab: int, seed: int, device="cpu", greedy_frac=0.3, onehot_frac=0.3):
    """Inputs for ``spec_sample`` with q close to p (so chains get accepted) and mixed row kinds."""
    gen = torch.Generator().manual_seed(seed)
    batch, total = len(num_drafts), sum(num_drafts)
    rows = torch.arange(batch).repeat_interleave(torch.tensor(num_drafts, dtype=torch.int64) + 1)  # (N + B,)
    j = torch.cat([torch.arange(k + 1) for k in num_drafts])  # (N + B,) position within the request
    target_logits = 2.0 * torch.randn(total + batch, vocab, generator=gen)
    target_probs = torch.softmax(target_logits, dim=-1)
    is_draft_row = j < torch.tensor(num_drafts)[rows]  # (N + B,) target rows that have a draft
    draft_logits = target_logits[is_draft_row] + 0.7 * torch.randn(total, vocab, generator=gen)  # (N, V)
    draft_probs = torch.softmax(draft_logits, dim=-1)
    onehot = torch.rand(batch, generator=gen) < onehot_frac
    greedy = torch.rand(batch, generator=gen) < greedy_frac
    sampled = torch.multinomial(draft_probs, 1, generator=gen).squeeze(1) if total else torch.zeros(0).long()
    mode = target_logits[is_draft_row].argmax(dim=-1)  # (N,)
    draft_rows = rows[is_draft_row]  # (N,)
    # one-hot and greedy rows draft the target's mode 80% of the time (like a good n-gram / greedy drafter)
    noise_tokens = torch.randint(0, vocab, (total,), generator=gen)
    deterministic = torch.where(torch.rand(total, generator=gen) < 0.8, mode, noise_tokens)
    drafts = torch.where((onehot | greedy)[draft_rows], deterministic, sampled)
    args = {
        "draft_token_ids": drafts,
        "cu_num_draft_tokens": make_cu(num_drafts),
        "draft_probs": draft_probs,
        "target_probs": target_probs,
        "target_argmax": target_logits.argmax(dim=-1),
        "is_greedy": greedy,
        "draft_is_onehot": onehot,
        "seeds": torch.randint(-(2**63), 2**63 - 1, (batch,), generator=gen),
        "positions": torch.randint(0, 1 << 40, (batch,), generator=gen),
        "max_num_draft_tokens": max(num_drafts, default=0),
    }
    return to_device(args, device)


def run_both(args, block_v=None):
    out, acc = spec_sample(**args, block_v=block_v)
    ref_out, ref_acc = spec_sample_reference(**args)
    return out, acc, ref_out, ref_acc


def check_invariants(out: torch.Tensor, acc: torch.Tensor, args) -> None:
    num_drafts = (args["cu_num_draft_tokens"][1:] - args["cu_num_draft_tokens"][:-1]).cpu()
    out, acc = out.cpu(), acc.cpu()
    assert out.shape == (num_drafts.numel(), args["max_num_draft_tokens"] + 1) and acc.dtype == torch.int32
    assert ((acc >= 0) & (acc <= num_drafts)).all()
    emitted = (out != -1).sum(dim=1)
    assert torch.equal(emitted, acc.long() + 1), "every row emits accepted + 1 tokens"
    cols = torch.arange(out.shape[1])
    assert (out[cols[None, :] > acc[:, None]] == -1).all(), "everything after the emitted prefix is -1"
    assert (out[cols[None, :] <= acc[:, None]] >= 0).all()
    drafts, cu = args["draft_token_ids"].cpu(), args["cu_num_draft_tokens"].cpu()
    for b in range(out.shape[0]):
        n = int(acc[b])
        assert torch.equal(out[b, :n], drafts[cu[b] : cu[b] + n]), f"row {b}: accepted prefix is not the drafts"


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(
    ("vocab", "num_rows", "block_v"),
    [(111, 120, None), (111, 40, 32), (1000, 64, 512)],
    ids=["v111", "v111-chunks32", "v1000-chunks512"],
)
def test_kernel_matches_reference(device, vocab, num_rows, block_v):
    gen = torch.Generator().manual_seed(vocab + num_rows)
    num_drafts = torch.randint(0, 9, (num_rows,), generator=gen).tolist()
    args = random_batch(num_drafts, vocab, seed=num_rows, device=device)
    out, acc, ref_out, ref_acc = run_both(args, block_v)
    torch.testing.assert_close(acc, ref_acc, rtol=0, atol=0)
    torch.testing.assert_close(out, ref_out, rtol=0, atol=0)
    check_invariants(out, acc, args)
    # the batch exercises every path
    sampled = ~args["is_greedy"].cpu()
    k = torch.tensor(num_drafts)
    assert ((acc.cpu() < k) & sampled).any() and ((acc.cpu() == k) & sampled & (k > 0)).any()
    assert ((acc.cpu() < k) & ~sampled).any() and ((acc.cpu() == k) & ~sampled & (k > 0)).any()


@pytest.mark.parametrize("device", DEVICES)
def test_all_onehot_without_draft_probs(device):
    args = random_batch([3, 0, 5, 1, 8, 2], vocab=64, seed=7, device=device, onehot_frac=1.0)
    args["draft_probs"] = None
    out, acc, ref_out, ref_acc = run_both(args)
    assert torch.equal(out, ref_out) and torch.equal(acc, ref_acc)
    check_invariants(out, acc, args)


# (draft tokens per request, target's token at positions 0..k per request, expected output row)
EXACT_CASES = {
    "all-accepted": ([[3, 1, 4]], [[3, 1, 4, 5]], [[3, 1, 4, 5]]),
    "early-mismatch": ([[3, 1, 4]], [[3, 2, 4, 5]], [[3, 2, -1, -1]]),
    "first-mismatch": ([[3, 1, 4]], [[0, 1, 4, 5]], [[0, -1, -1, -1]]),
    "zero-drafts": ([[]], [[6]], [[6]]),
    "ragged-mixed": (
        [[1, 2], [], [5, 5, 5, 5], [7]],
        [[1, 2, 3], [4], [5, 5, 0, 9, 9], [6, 7]],
        [[1, 2, 3, -1, -1], [4, -1, -1, -1, -1], [5, 5, 0, -1, -1], [6, -1, -1, -1, -1]],
    ),
}


def check_exact_case(run, case: str, kind: str, device) -> None:
    """``run(args) -> (out, acc, ref_out, ref_acc)`` on ``EXACT_CASES[case]`` with one-hot targets: kernel and
    reference emit exactly the expected rows, for every row ``kind`` (greedy, sampled-model, sampled-onehot)."""
    drafts, targets, expected = EXACT_CASES[case]
    vocab, batch = 10, len(drafts)
    target_tokens = [t for row in targets for t in row]
    flat_drafts = [d for row in drafts for d in row]
    draft_probs = torch.softmax(torch.randn(len(flat_drafts), vocab, generator=torch.Generator().manual_seed(0)), -1)
    args = {
        "draft_token_ids": torch.tensor(flat_drafts, dtype=torch.int64),
        "cu_num_draft_tokens": make_cu([len(row) for row in drafts]),
        "draft_probs": draft_probs,
        "target_probs": onehot_probs(target_tokens, vocab),
        "target_argmax": torch.tensor(target_tokens, dtype=torch.int64),
        "is_greedy": torch.full((batch,), kind == "greedy"),
        "draft_is_onehot": torch.full((batch,), kind == "sampled-onehot"),
        "seeds": torch.arange(batch, dtype=torch.int64) * 7919,
        "positions": torch.arange(batch, dtype=torch.int64) * 100,
        "max_num_draft_tokens": max(len(row) for row in drafts),
    }
    expected = torch.tensor(expected, dtype=torch.int64)
    expected_accepted = ((expected != -1).sum(dim=1) - 1).int()
    out, acc, ref_out, ref_acc = run(to_device(args, device))
    for name, (o, a) in {"kernel": (out, acc), "reference": (ref_out, ref_acc)}.items():
        assert torch.equal(o.cpu(), expected), f"{name}: {o.tolist()} != {expected.tolist()}"
        assert torch.equal(a.cpu(), expected_accepted), f"{name}: accepted {a.tolist()}"


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kind", ["greedy", "sampled-model", "sampled-onehot"])
@pytest.mark.parametrize("case", list(EXACT_CASES))
def test_exact_onehot_targets(device, kind, case):
    check_exact_case(run_both, case, kind, device)


def zero_residual_args(num_drafts: list[int], vocab: int, device) -> tuple[dict, torch.Tensor]:
    """Sampled rows with one-hot p and q = 2p at every draft (so max(w p - q, 0) is all zero for w <= 1):
    ``(args, target token per target row int64 [N + B])``."""
    tokens = (torch.arange(sum(num_drafts) + len(num_drafts)) * 7 + 3) % vocab  # target token per row
    target_probs = onehot_probs(tokens.tolist(), vocab)
    rows = torch.arange(len(num_drafts)).repeat_interleave(torch.tensor(num_drafts))
    draft_rows = torch.arange(sum(num_drafts)) + rows  # target row of each draft
    args = {
        "draft_token_ids": tokens[draft_rows],
        "cu_num_draft_tokens": make_cu(num_drafts),
        "draft_probs": 2.0 * target_probs[draft_rows],
        "target_probs": target_probs,
        "target_argmax": tokens,
        "is_greedy": torch.zeros(len(num_drafts), dtype=torch.bool),
        "draft_is_onehot": torch.zeros(len(num_drafts), dtype=torch.bool),
        "seeds": torch.arange(len(num_drafts), dtype=torch.int64) + 11,
        "positions": torch.zeros(len(num_drafts), dtype=torch.int64),
        "max_num_draft_tokens": max(num_drafts),
    }
    return to_device(args, device), tokens


def check_emitted_from_p(out: torch.Tensor, acc: torch.Tensor, num_drafts: list[int], tokens: torch.Tensor) -> None:
    """Each row's last token is the (one-hot) target's token at that position: it was drawn from p."""
    cu = make_cu(num_drafts)
    for b in range(len(num_drafts)):
        n = int(acc[b])
        assert out[b, n] == tokens[cu[b] + b + n], f"row {b}: the fallback did not sample from p"


@pytest.mark.parametrize("device", DEVICES)
def test_all_zero_residual_falls_back_to_p(device):
    """q = 2p >= p everywhere: drafts are rejected half the time and max(p - q, 0) is all zero, so the token
    must come from p itself (here one-hot at the drafted token, so every emitted token is that token)."""
    num_drafts = [3, 5, 2, 4, 6, 1]
    args, tokens = zero_residual_args(num_drafts, vocab=40, device=device)
    out, acc, ref_out, ref_acc = run_both(args)
    assert torch.equal(out, ref_out) and torch.equal(acc, ref_acc)
    check_invariants(out, acc, args)
    assert (acc.cpu() < torch.tensor(num_drafts)).any(), "some draft must be rejected for the test to mean anything"
    check_emitted_from_p(out, acc, num_drafts, tokens)


def check_seeded_determinism(fn, device, **fractions) -> None:
    """``fn`` (a chain launcher) gives the same tokens for the same seeds, a row's tokens do not depend on its
    batch, and another seed changes them. ``fractions``: ``random_batch``'s greedy_frac / onehot_frac."""
    num_drafts = [4, 0, 7, 2, 8, 1]
    args = random_batch(num_drafts, vocab=97, seed=3, device=device, **fractions)
    out, acc = fn(**args)
    out_again, acc_again = fn(**args)
    assert torch.equal(out, out_again) and torch.equal(acc, acc_again), "same seeds must give the same tokens"

    # Rows reversed and a row alone: each row's tokens depend only on its own inputs, not on its batch row.
    for order in ([5, 4, 3, 2, 1, 0], [2], [4, 2]):
        sub = select_rows(args, order)
        sub_out, sub_acc = fn(**sub)
        for i, b in enumerate(order):
            width = num_drafts[b] + 1
            assert torch.equal(sub_out[i, :width], out[b, :width]), f"row {b} changed when batched as {order}"
            assert sub_acc[i] == acc[b]

    # A different seed changes the residual/bonus draws (flat p, so the tokens almost surely differ).
    reseeded = dict(args, seeds=args["seeds"] + 1)
    assert not torch.equal(fn(**reseeded)[0], out)


@pytest.mark.parametrize("device", DEVICES)
def test_seeded_determinism_and_batch_independence(device):
    check_seeded_determinism(spec_sample, device, greedy_frac=0.0)


def select_rows(args, order: list[int]):
    """The inputs of requests ``order`` (in that order) as a new flattened batch."""
    cu = args["cu_num_draft_tokens"].cpu().long()
    draft_idx = torch.cat([torch.arange(cu[b], cu[b + 1]) for b in order])
    target_idx = torch.cat([torch.arange(cu[b] + b, cu[b + 1] + b + 1) for b in order])
    num_drafts = [int(cu[b + 1] - cu[b]) for b in order]
    device = args["target_probs"].device
    rows = torch.tensor(order, device=device)
    return {
        "draft_token_ids": args["draft_token_ids"][draft_idx.to(device)],
        "cu_num_draft_tokens": make_cu(num_drafts, device),
        "draft_probs": args["draft_probs"][draft_idx.to(device)],
        "target_probs": args["target_probs"][target_idx.to(device)],
        "target_argmax": args["target_argmax"][target_idx.to(device)],
        "is_greedy": args["is_greedy"][rows],
        "draft_is_onehot": args["draft_is_onehot"][rows],
        "seeds": args["seeds"][rows],
        "positions": args["positions"][rows],
        "max_num_draft_tokens": max(num_drafts),
    }


def test_ops_dispatch_matches_kernel():
    check_ops_dispatch(ops.spec_sample, random_batch([2, 5, 0], vocab=50, seed=11))


def empty_chain_args() -> dict:
    """The arguments of an empty batch (B = 0, N = 0, V = 16)."""
    empty_long = torch.zeros(0, dtype=torch.int64)
    return {
        "draft_token_ids": empty_long, "cu_num_draft_tokens": torch.zeros(1, dtype=torch.int32),
        "draft_probs": torch.zeros(0, 16), "target_probs": torch.zeros(0, 16), "target_argmax": empty_long,
        "is_greedy": torch.zeros(0, dtype=torch.bool), "draft_is_onehot": torch.zeros(0, dtype=torch.bool),
        "seeds": empty_long, "positions": empty_long, "max_num_draft_tokens": 0,
    }  # fmt: skip


def test_empty_batch_and_config():
    for fn in (spec_sample, spec_sample_reference):
        out, acc = fn(**empty_chain_args())
        assert out.shape == (0, 1) and acc.shape == (0,)
    assert spec_sample_config(111).block_v == 128
    assert spec_sample_config(151936).block_v == 2048
    with pytest.raises(ValueError, match="vocab_size"):
        spec_sample_config(0)


BAD_INPUTS = {
    "cu-int64": (lambda a: with_changes(a, cu_num_draft_tokens=a["cu_num_draft_tokens"].long()),
                 "cu_num_draft_tokens"),
    "drafts-int32": (lambda a: with_changes(a, draft_token_ids=a["draft_token_ids"].int()), "draft_token_ids"),
    **COMMON_BAD_INPUTS,
    "max-k-too-small": (lambda a: with_changes(a, max_num_draft_tokens=2), "max_num_draft_tokens"),
    "max-k-negative": (lambda a: with_changes(a, max_num_draft_tokens=-1), "max_num_draft_tokens"),
    "draft-out-of-vocab": (
        lambda a: with_changes(a, draft_token_ids=torch.where(torch.arange(5) == 1, 10**6, a["draft_token_ids"])),
        "draft_token_ids",
    ),
    "cu-wrong-total": (lambda a: with_changes(a, cu_num_draft_tokens=a["cu_num_draft_tokens"] - 1),
                       "cu_num_draft_tokens"),
}  # fmt: skip


def bad_input_batch() -> dict:
    """The batch the bad-input cases spoil: 5 drafts (the out-of-vocab case indexes draft 1), no one-hot rows."""
    args = random_batch([1, 3, 1], vocab=12, seed=5, onehot_frac=0.0)
    assert args["draft_token_ids"].numel() == 5
    return args


@pytest.mark.parametrize("case", list(BAD_INPUTS))
@pytest.mark.parametrize("fn", [spec_sample, spec_sample_reference], ids=["launcher", "reference"])
def test_validation_errors(fn, case):
    check_bad_input(fn, bad_input_batch(), BAD_INPUTS, case)
