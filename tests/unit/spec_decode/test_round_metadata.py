"""The round as data: ``SpecDecodeMetadata`` (one round's layout, built once) and ``StepOutput`` (the step's one
host read), on hand-made rounds whose every offset is known."""

from __future__ import annotations

import pytest
import torch

from specdec.device import StepOutput
from specdec.spec_decode.metadata import SpecDecodeMetadata
from specdec.spec_decode.proposers.base import DraftProposal
from specdec.spec_decode.tree import DraftTree

CPU = torch.device("cpu")


def test_chain_round_with_plain_rows_between_windows():
    # the step's logits rows: 0 = a plain decode, 1..3 = request A's window (2 drafts), 4 = plain, 5..6 = B's (1)
    proposal = DraftProposal([[5, 6], [7]], None, [True, False])
    meta = SpecDecodeMetadata.build(proposal, logits_starts=[1, 5], input_starts=[1, 9], num_logits=7, device=CPU)
    assert meta.num_draft_tokens == [2, 1] and meta.max_num_draft_tokens == 2 and meta.max_depth == 2
    assert meta.cu_num_draft_tokens.tolist() == [0, 2, 3] and meta.cu_num_draft_tokens.dtype == torch.int32
    assert meta.cu_window_rows.tolist() == [0, 3, 5]
    assert meta.target_logits_indices.tolist() == [1, 2, 3, 5, 6] and meta.window_starts.tolist() == [0, 3]
    assert meta.draft_token_ids.tolist() == [5, 6, 7] and meta.draft_input_indices is None  # drafts on the host
    assert meta.draft_is_onehot_mask.tolist() == [True, False] and not meta.all_rows
    logits = torch.arange(7.0)[:, None].expand(7, 3)
    assert meta.verification_logits(logits)[:, 0].tolist() == [1, 2, 3, 5, 6]


def test_windows_that_are_all_the_rows_are_not_gathered():
    meta = SpecDecodeMetadata.build(DraftProposal([[5], [6, 7]], None, [True, True]), [0, 2], [0, 2], 5, CPU)
    logits = torch.randn(5, 4)
    assert meta.all_rows and meta.verification_logits(logits) is logits


def test_device_drafts_are_scattered_into_the_input_ids():
    # a draft model's chains: drafts only on the device; windows start at input positions 3 and 7
    device_ids = torch.tensor([40, 41, 42])
    proposal = DraftProposal(None, None, [True, True], device_ids=device_ids, num_drafts=[2, 1])
    meta = SpecDecodeMetadata.build(proposal, logits_starts=[1, 4], input_starts=[3, 7], num_logits=6, device=CPU)
    assert meta.draft_token_ids is device_ids and meta.draft_token_ids_host is None
    assert meta.draft_input_indices.tolist() == [4, 5, 8]  # after each window's last committed token
    ids = meta.scatter_drafts(torch.zeros(10, dtype=torch.int64))
    assert ids.tolist() == [0, 0, 0, 0, 40, 41, 0, 0, 42, 0]


def test_tree_round_carries_every_node_and_parent():
    trees = [DraftTree((9, 1, 2, 3), (-1, 0, 1, 0)), DraftTree((8, 4), (-1, 0))]  # 3 + 1 drafted nodes
    proposal = DraftProposal([list(t.token_ids[1:]) for t in trees], None, [True, True], trees=trees)
    meta = SpecDecodeMetadata.build(proposal, logits_starts=[0, 4], input_starts=[0, 4], num_logits=6, device=CPU)
    assert meta.num_draft_tokens == [3, 1] and meta.max_depth == 2
    assert meta.tree_token_ids.tolist() == [9, 1, 2, 3, 8, 4]
    assert meta.tree_parents.tolist() == [-1, 0, 1, 0, -1, 0] and meta.tree_parents.dtype == torch.int32
    assert meta.cu_window_rows.tolist() == [0, 4, 6] and meta.all_rows


def test_step_output_reads_everything_in_one_tolist(monkeypatch):
    out = StepOutput()
    a = out.add(torch.tensor([1, 2, 3]))
    b = out.add(torch.tensor([True, False]))
    c = out.add(torch.tensor([7], dtype=torch.int32))
    calls = []
    tolist = torch.Tensor.tolist
    monkeypatch.setattr(torch.Tensor, "tolist", lambda self: calls.append(1) or tolist(self))
    with pytest.raises(RuntimeError, match="before read"):
        out.get(a)
    out.read()
    out.read()  # a second read is a no-op
    assert calls == [1]
    assert out.get(a) == [1, 2, 3] and out.get(b) == [1, 0] and out.get(c) == [7]
    with pytest.raises(RuntimeError, match="after read"):
        out.add(torch.tensor([1]))
    with pytest.raises(ValueError, match="1-D"):
        StepOutput().add(torch.zeros(2, 2))
