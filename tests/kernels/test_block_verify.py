"""The block verification kernel against its torch reference: equality, exact cases, fallbacks, validation.

On CPU the kernel runs in the Triton interpreter, so vocabularies stay small and ``block_v`` is forced below the
vocabulary to cover the chunked loops (residual mass and argmax). The inputs, invariants and bad-input table are
spec_sample's (same layout and contract); its distributional properties are in test_block_verify_statistics.py.
"""

from __future__ import annotations

import pytest
import torch
from test_spec_sample import (
    BAD_INPUTS,
    EXACT_CASES,
    bad_input_batch,
    check_emitted_from_p,
    check_exact_case,
    check_invariants,
    check_seeded_determinism,
    empty_chain_args,
    random_batch,
    zero_residual_args,
)
from verify_helpers import DEVICES, check_bad_input, check_ops_dispatch

from specdec import ops
from specdec.kernels.block_verify import block_verify, block_verify_reference
from specdec.kernels.spec_sample import spec_sample_reference


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
    check_exact_case(run_both, case, kind, device)


@pytest.mark.parametrize("device", DEVICES)
def test_all_zero_residual_falls_back_to_p(device):
    """q = 2p at a one-hot p: every weight is below 1 and every residual max(w p - q, 0) is zero, so tau = k
    (with probability w_k) or tau = 0 with the token drawn from p itself: every emitted token is the target's."""
    num_drafts = [3, 5, 2, 4, 6, 1, 1, 1]
    args, tokens = zero_residual_args(num_drafts, vocab=40, device=device)
    out, acc, ref_out, ref_acc = run_both(args)
    assert torch.equal(out, ref_out) and torch.equal(acc, ref_acc)
    check_invariants(out, acc, args)
    k = torch.tensor(num_drafts)
    assert ((acc.cpu() == 0) & (k > 0)).any(), "some block must fall back to p at tau = 0"
    assert set(acc.cpu().tolist()) <= {0} | set(num_drafts), "tau is 0 or k: no intermediate stop"
    check_emitted_from_p(out, acc, num_drafts, tokens)


@pytest.mark.parametrize("device", DEVICES)
def test_seeded_determinism_and_batch_independence(device):
    check_seeded_determinism(block_verify, device, greedy_frac=0.0, onehot_frac=0.0)


def test_ops_dispatch_matches_kernel():
    args = random_batch([2, 5, 0, 3], vocab=50, seed=11, greedy_frac=0.0, onehot_frac=0.0)
    check_ops_dispatch(ops.block_verify, args)


def test_empty_batch():
    for fn in (block_verify, block_verify_reference):
        out, acc = fn(**empty_chain_args())
        assert out.shape == (0, 1) and acc.shape == (0,)


@pytest.mark.parametrize("case", list(BAD_INPUTS))
@pytest.mark.parametrize("fn", [block_verify, block_verify_reference], ids=["launcher", "reference"])
def test_validation_errors(fn, case):
    check_bad_input(fn, bad_input_batch(), BAD_INPUTS, case)


def test_bad_block_v():
    args = random_batch([1, 2], vocab=12, seed=5)
    with pytest.raises(ValueError, match="block_v"):
        block_verify(**args, block_v=24)
