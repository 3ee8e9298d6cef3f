"""The block verification kernel against its torch reference: equality, exact cases, fallbacks, validation.

On CPU the kernel runs in the Triton interpreter, so vocabularies stay small and ``block_v`` is forced below the
vocabulary to cover the chunked loops (residual mass and argmax). The inputs, invariants and bad-input table are
spec_sample's (same layout and contract); its distributional properties are in test_block_verify_statistics.py.
"""

from __future__ import annotations

import pytest
import torch
from test_spec_sample import BAD_INPUTS, EXACT_CASES, check_invariants, make_cu, onehot_probs, random_batch, select_rows

from specdec import ops
from specdec.kernels.block_verify import block_verify, block_verify_reference
from specdec.kernels.spec_sample import spec_sample_reference

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def run_both(args, block_v=None):
    out, acc = block_verify(**args, block_v=block_v)
    ref_out, ref_acc = block_verify_reference(**args)
    return out, acc, ref_out, ref_acc


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(
    ("vocab", "num_rows", "block_v"),
    [(111, 32, None), (111, 16, 32), (300, 12, 128)],
    ids=["v111", "v111-chunks32", "v300-chunks128"],
)
def test_kernel_matches_reference(device, vocab, num_rows, block_v):
    gen = torch.Generator().manual_seed(vocab + num_rows)
    num_drafts = torch.randint(0, 9, (num_rows,), generator=gen).tolist()
    num_drafts[:2] = [0, 8]  # a bonus-only row and a full-length row in every batch
    args = random_batch(num_drafts, vocab, seed=num_rows, device=device)
    out, acc, ref_out, ref_acc = run_both(args, block_v)
    torch.testing.assert_close(acc, ref_acc, rtol=0, atol=0)
    torch.testing.assert_close(out, ref_out, rtol=0, atol=0)
    check_invariants(out, acc, args)
    # greedy and one-hot rows are spec_sample's, bit for bit
    token_wise = (args["is_greedy"] | args["draft_is_onehot"]).cpu()
    spec_out, spec_acc = spec_sample_reference(**args)
    assert torch.equal(out.cpu()[token_wise], spec_out.cpu()[token_wise])
    assert torch.equal(acc.cpu()[token_wise], spec_acc.cpu()[token_wise])
    # the batch exercises every path: block rows stopping early, stopping at k, and greedy / one-hot rows
    block = ~token_wise
    k = torch.tensor(num_drafts)
    assert block.any() and token_wise.any()
    assert ((acc.cpu() < k) & block).any() and ((acc.cpu() == k) & block & (k > 0)).any()
    assert ((acc.cpu() > 0) & (acc.cpu() < k) & block).any()


@pytest.mark.parametrize("device", DEVICES)
def test_all_onehot_without_draft_probs_is_token_wise(device):
    args = random_batch([3, 0, 5, 1, 8, 2], vocab=64, seed=7, device=device, onehot_frac=1.0)
    args["draft_probs"] = None
    out, acc, ref_out, ref_acc = run_both(args)
    spec_out, spec_acc = spec_sample_reference(**args)
    assert torch.equal(out, ref_out) and torch.equal(acc, ref_acc)
    assert torch.equal(out.cpu(), spec_out.cpu()) and torch.equal(acc.cpu(), spec_acc.cpu())
    check_invariants(out, acc, args)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kind", ["greedy", "sampled-model", "sampled-onehot"])
@pytest.mark.parametrize("case", list(EXACT_CASES))
def test_exact_onehot_targets(device, kind, case):
    """A one-hot target: the weights are 1 while the drafts match it and 0 after, every matching prefix stops
    (h = r / r = 1), and the residual is the target's token - so block emits exactly what token-wise does."""
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
    args = {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in args.items()}
    expected = torch.tensor(expected, dtype=torch.int64)
    expected_accepted = ((expected != -1).sum(dim=1) - 1).int()
    out, acc, ref_out, ref_acc = run_both(args)
    for name, (o, a) in {"kernel": (out, acc), "reference": (ref_out, ref_acc)}.items():
        assert torch.equal(o.cpu(), expected), f"{name}: {o.tolist()} != {expected.tolist()}"
        assert torch.equal(a.cpu(), expected_accepted), f"{name}: accepted {a.tolist()}"


@pytest.mark.parametrize("device", DEVICES)
def test_all_zero_residual_falls_back_to_p(device):
    """q = 2p at a one-hot p: every weight is below 1 and every residual max(w p - q, 0) is zero, so tau = k
    (with probability w_k) or tau = 0 with the token drawn from p itself: every emitted token is the target's."""
    num_drafts, vocab = [3, 5, 2, 4, 6, 1, 1, 1], 40
    tokens = (torch.arange(sum(num_drafts) + len(num_drafts)) * 7 + 3) % vocab  # target token per row
    target_probs = onehot_probs(tokens.tolist(), vocab)
    cu = make_cu(num_drafts)
    rows = torch.arange(len(num_drafts)).repeat_interleave(torch.tensor(num_drafts))
    draft_rows = torch.arange(sum(num_drafts)) + rows  # target row of each draft
    args = {
        "draft_token_ids": tokens[draft_rows],
        "cu_num_draft_tokens": cu,
        "draft_probs": 2.0 * target_probs[draft_rows],
        "target_probs": target_probs,
        "target_argmax": tokens,
        "is_greedy": torch.zeros(len(num_drafts), dtype=torch.bool),
        "draft_is_onehot": torch.zeros(len(num_drafts), dtype=torch.bool),
        "seeds": torch.arange(len(num_drafts), dtype=torch.int64) + 11,
        "positions": torch.zeros(len(num_drafts), dtype=torch.int64),
        "max_num_draft_tokens": max(num_drafts),
    }
    args = {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in args.items()}
    out, acc, ref_out, ref_acc = run_both(args)
    assert torch.equal(out, ref_out) and torch.equal(acc, ref_acc)
    check_invariants(out, acc, args)
    k = torch.tensor(num_drafts)
    assert ((acc.cpu() == 0) & (k > 0)).any(), "some block must fall back to p at tau = 0"
    assert set(acc.cpu().tolist()) <= {0} | set(num_drafts), "tau is 0 or k: no intermediate stop"
    for b in range(len(num_drafts)):
        n = int(acc[b])
        assert out[b, n] == tokens[cu[b] + b + n], f"row {b}: the fallback did not sample from p"


@pytest.mark.parametrize("device", DEVICES)
def test_seeded_determinism_and_batch_independence(device):
    num_drafts = [4, 0, 7, 2, 8, 1]
    args = random_batch(num_drafts, vocab=97, seed=3, device=device, greedy_frac=0.0, onehot_frac=0.0)
    out, acc = block_verify(**args)
    out_again, acc_again = block_verify(**args)
    assert torch.equal(out, out_again) and torch.equal(acc, acc_again), "same seeds must give the same tokens"
    for order in ([5, 4, 3, 2, 1, 0], [2], [4, 2]):
        sub = select_rows(args, order)
        sub_out, sub_acc = block_verify(**sub)
        for i, b in enumerate(order):
            width = num_drafts[b] + 1
            assert torch.equal(sub_out[i, :width], out[b, :width]), f"row {b} changed when batched as {order}"
            assert sub_acc[i] == acc[b]
    reseeded = dict(args, seeds=args["seeds"] + 1)
    assert not torch.equal(block_verify(**reseeded)[0], out)


def test_ops_dispatch_matches_kernel():
    args = random_batch([2, 5, 0, 3], vocab=50, seed=11, greedy_frac=0.0, onehot_frac=0.0)
    ref = ops.block_verify(**args)  # CPU tensors: the reference
    with ops.force_triton():
        kernel = ops.block_verify(**args)
    assert torch.equal(ref[0], kernel[0]) and torch.equal(ref[1], kernel[1])


def test_empty_batch():
    empty_long = torch.zeros(0, dtype=torch.int64)
    args = {
        "draft_token_ids": empty_long, "cu_num_draft_tokens": torch.zeros(1, dtype=torch.int32),
        "draft_probs": torch.zeros(0, 16), "target_probs": torch.zeros(0, 16), "target_argmax": empty_long,
        "is_greedy": torch.zeros(0, dtype=torch.bool), "draft_is_onehot": torch.zeros(0, dtype=torch.bool),
        "seeds": empty_long, "positions": empty_long, "max_num_draft_tokens": 0,
    }  # fmt: skip
    for fn in (block_verify, block_verify_reference):
        out, acc = fn(**args)
        assert out.shape == (0, 1) and acc.shape == (0,)


@pytest.mark.parametrize("case", list(BAD_INPUTS))
@pytest.mark.parametrize("fn", [block_verify, block_verify_reference], ids=["launcher", "reference"])
def test_validation_errors(fn, case):
    args = random_batch([1, 3, 1], vocab=12, seed=5, onehot_frac=0.0)
    assert args["draft_token_ids"].numel() == 5
    make_bad, match = BAD_INPUTS[case]
    with pytest.raises(ValueError, match=match):
        fn(**make_bad(args))


def test_bad_block_v():
    args = random_batch([1, 2], vocab=12, seed=5)
    with pytest.raises(ValueError, match="block_v"):
        block_verify(**args, block_v=24)
