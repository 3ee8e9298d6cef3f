"""The vocabulary-parallel embedding (the LM head's counterpart is a plain ``Linear`` over the same rows, whose
logits ``LlamaForCausalLM.logits`` gathers)."""

from __future__ import annotations

import torch
from torch import nn

from specdec.distributed.comm import TPGroup
from specdec.distributed.sharding import ShardLayout


class VocabParallelEmbedding(nn.Module):
    """Rows ``[vocab_start, vocab_start + vocab_per_rank)`` of the embedding; ``forward(ids int64 [T]) -> [T,
    hidden]`` looks up the ids this rank owns, zeros the others and sums over the ranks (one all-reduce)."""

    def __init__(self, layout: ShardLayout, hidden_size: int, group: TPGroup):
        super().__init__()
        self.vocab_start = layout.vocab_start
        self.vocab_per_rank = layout.vocab_per_rank
        self.group = group
        self.weight = nn.Parameter(torch.empty(layout.vocab_per_rank, hidden_size))  # (V / N, hidden)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        local = ids - self.vocab_start  # (T,)
        outside = (local < 0) | (local >= self.vocab_per_rank)  # (T,) ids another rank owns
        x = nn.functional.embedding(local.masked_fill(outside, 0), self.weight)  # (T, hidden)
        x = x.masked_fill(outside.unsqueeze(-1), 0)
        return self.group.all_reduce(x)
