"""An LM head cut to a subset of the vocabulary: a draft model's reduced draft vocabulary
(specdec/spec_decode/proposers/draft_vocab.py).

``restrict_lm_head`` replaces ``model.lm_head`` (``[V, hidden]``) by a head of the rows of the given token ids, so
the model's logits are ``[N, |S|]``; the rest of the model - its embedding included - is untouched, so it still
reads every token id. Call it on a freshly loaded model whose head is still plain (not prepacked, not quantised);
prepacking and quantisation then apply to the cut head (``prepack_linears``; ``quantization``).

NOTE: the full head is read once while loading and dropped here (an untied head: no copy of it stays; a tied one:
the embedding keeps its rows and the head is a gathered copy of |S| of them). Reading only the subset's rows from
the checkpoint would save that transient ``V x hidden``, at the cost of a separate loading path for one tensor.
"""

from __future__ import annotations

import torch
from torch import nn

from specdec.model.linear import Linear
from specdec.model.llama import LlamaForCausalLM
from specdec.model.quant.linear import QuantizedLinear


def restrict_lm_head(model: LlamaForCausalLM, token_ids: torch.Tensor, quantization: str | None = None,
                     group_size: int | None = None) -> None:
    """Give ``model`` an LM head over ``token_ids`` only: logits ``[N, S]``, column c the logit of token
    ``token_ids[c]`` (exactly what the full head computes for it).

    Args:
        model: a loaded single-process model (no tensor parallelism) whose ``lm_head`` is a plain ``Linear``.
        token_ids: int64 ``[S]``, distinct ids in ``[0, V)`` (ascending, for the callers' column order).
        quantization / group_size: quantise the cut head ("int8" / "int4", specdec/model/quant/); None: keep it in
            the model dtype.
    """
    head = model.lm_head
    assert model.group is None, "a reduced draft vocabulary needs a draft on one rank (draft_tensor_parallel_size=1)"
    assert isinstance(head, Linear) and head.packed_weight is None and not head.weight_released, \
        "restrict_lm_head needs the plain head: load with prepack_weights=False and an unquantised head"
    weight = head.weight.detach()  # (V, hidden), the embedding's rows when tied
    rows = weight.index_select(0, token_ids.to(weight.device))  # (S, hidden): a copy, never a view of the head
    if quantization is not None:
        cut = QuantizedLinear.from_weight(rows, None, quantization, group_size)
        cut.prepare(rows.device)
    else:
        cut = Linear(rows.shape[1], rows.shape[0], bias=False, device="meta", dtype=rows.dtype)
        cut.weight = nn.Parameter(rows, requires_grad=False)
    model.lm_head = cut  # an untied head's full rows are freed with it
