"""ModelDrafter: what the shared drafting loops (``chain_drafting.draft_chains``, ``tree_drafting.propose_tree``)
read of a drafter that runs a model - a draft model (``draft_model.py``) or an EAGLE-3 head (``eagle3.py``).

Everything the loops touch is declared here and public; a new model drafter implements these members and gets
chains, trees, the draft loop's fast path and reduced draft vocabularies without touching the loops.
"""

from __future__ import annotations

from typing import Protocol

import torch

from specdec.runner.draft_loop import DraftLoopRunner, LoopOutput
from specdec.runner.model_runner import ForwardItem, ModelRunner
from specdec.spec_decode.proposers.draft_vocab import DraftVocab
from specdec.spec_decode.request import RequestView


class ModelDrafter(Protocol):
    runner: ModelRunner  # its own forward, pool and block manager (``runner.device``: where its tensors live)
    draft_vocab: DraftVocab | None  # a reduced draft vocabulary: logits columns -> target ids (None: column c is id c)
    target_vocab_size: int  # q rows are laid out over the target's vocabulary
    tree_positions: dict[int, dict[int, int]]  # seq id -> {tree node -> its position in the drafter's cache}

    # --- chains (chain_drafting.draft_chains) ---
    def chain_step(self, seqs: list[RequestView], active: list[int], step: int, input_ids: torch.Tensor | None,
                   kept: torch.Tensor | None) -> torch.Tensor:
        """Draft step ``step`` over requests ``active`` (indices into ``seqs``): logits ``[len(active), W]``. Step 0
        catches the drafter's cache up; later steps feed ``input_ids`` (int64 ``[len(active)]``, the previous
        step's drafts on the device; ``kept``: the previous step's rows still drafting, None for all)."""
        ...

    def sample_step(self, logits: torch.Tensor, seqs: list[RequestView], step: int,
                    drafts: list[list[int]] | None, bad_rows: list[torch.Tensor]
                    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(target ids int64 ``[R]``, q fp32 ``[R, W]`` or None for greedy rows) drawn from ``logits``; NaN/inf rows
        appended to ``bad_rows`` (bool ``[R]``), not raised."""
        ...

    def pure_steps(self, seqs: list[RequestView], active: list[int], input_ids: torch.Tensor,
                   steps: int) -> LoopOutput | None:
        """Steps 1 .. ``steps`` as one program (the draft loop), or None: the caller runs them step by step."""
        ...

    # --- trees (tree_drafting.propose_tree) ---
    def in_vocab(self, ids: list[int]) -> list[int]:
        """``ids`` as the drafter may be fed them (ids beyond its vocabulary replaced)."""
        ...

    def tree_root_position(self, seq: RequestView) -> int:
        """Where the tree's root sits in the drafter's cache (the nodes follow it)."""
        ...

    def tree_root_forward(self, seqs: list[RequestView]) -> torch.Tensor:
        """The catch-up forward: logits ``[len(seqs), W]`` at each root."""
        ...

    def tree_level_forward(self, items: list[ForwardItem], parent_rows: list[int]) -> torch.Tensor:
        """One depth of nodes (one item per request); ``parent_rows``: each node's parent's row in the previous
        tree forward. Logits ``[sum(item rows), W]``."""
        ...


class DraftModel(ModelDrafter, Protocol):
    """A model drafter with its own static forward and draft loop (``DraftModelProposer``): what the engine sets
    up at start-up (``Proposer.draft_model``) and calibration times (``runner``)."""

    loop: DraftLoopRunner | None  # the pure steps of chain rounds as one program (None: step by step)

    def enable_draft_loop(self, mode: str, max_seq_len: int, max_batch: int, max_steps: int) -> None:
        """Run chain rounds' pure steps as one program per bucket (``mode``: "cuda_graph" or "eager")."""
        ...
