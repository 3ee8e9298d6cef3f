"""Helpers shared by the verification kernel tests (spec_sample, block_verify, tree_sample): argument dicts on a
device, cumulative offsets, the bad-input cases common to every layout, and the checks that the chain kernels
(spec_sample and block_verify, same arguments and outputs) run alike."""

from __future__ import annotations

import pytest
import torch

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def to_device(args: dict, device) -> dict:
    """``args`` with every tensor moved to ``device`` (ints and None as they are)."""
    return {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in args.items()}


def make_cu(sizes: list[int], device="cpu") -> torch.Tensor:
    """int32 ``[B + 1]`` cumulative offsets of ``sizes`` (cu[0] = 0)."""
    cu = torch.zeros(len(sizes) + 1, dtype=torch.int32)
    cu[1:] = torch.tensor(sizes, dtype=torch.int64).cumsum(0)
    return cu.to(device)


def onehot_probs(tokens: list[int], vocab: int) -> torch.Tensor:
    """Rows of softmax over +-100 logits: exactly one-hot in fp32 (exp(-200) underflows to 0)."""
    logits = torch.full((len(tokens), vocab), -100.0)
    logits[torch.arange(len(tokens)), torch.tensor(tokens)] = 100.0
    return torch.softmax(logits, dim=-1)


def with_changes(args: dict, **changes) -> dict:
    return dict(args, **changes)


# Bad inputs named alike in every verification layout: (make the bad arguments, what the ValueError must name).
COMMON_BAD_INPUTS = {
    "probs-fp16": (lambda a: with_changes(a, target_probs=a["target_probs"].half()), "target_probs"),
    "target-rows": (lambda a: with_changes(a, target_probs=a["target_probs"][:-1]), "target_probs"),
    "draft-vocab": (lambda a: with_changes(a, draft_probs=a["draft_probs"][:, :-1]), "draft_probs"),
    "argmax-rows": (lambda a: with_changes(a, target_argmax=a["target_argmax"][:-1]), "target_argmax"),
    "greedy-int": (lambda a: with_changes(a, is_greedy=a["is_greedy"].int()), "is_greedy"),
    "seeds-batch": (lambda a: with_changes(a, seeds=a["seeds"][:-1]), "seeds"),
    "non-contiguous": (lambda a: with_changes(a, target_probs=a["target_probs"].t().contiguous().t()), "contiguous"),
    "none-needs-onehot": (lambda a: with_changes(a, draft_probs=None), "one-hot"),
}


def check_bad_input(fn, args: dict, bad_inputs: dict, case: str) -> None:
    """``fn`` on ``args`` spoilt by ``bad_inputs[case]`` raises a ValueError naming what was wrong."""
    make_bad, match = bad_inputs[case]
    with pytest.raises(ValueError, match=match):
        fn(**make_bad(args))


def check_ops_dispatch(op, args: dict) -> None:
    """``op`` (an ``ops`` entry) on CPU tensors (the reference) and under ``force_triton`` (the kernel, in the
    interpreter) gives the same outputs, element for element."""
    from specdec import ops

    reference = op(**args)
    with ops.force_triton():
        kernel = op(**args)
    assert len(kernel) == len(reference)
    for k, r in zip(kernel, reference):
        assert torch.equal(k, r)
